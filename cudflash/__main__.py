from cudflash.cli import main

main()
