"""`cudflash serve`: an OpenAI-compatible HTTP server (needs the `serve` extra: starlette and uvicorn).

Modules: protocol.py (the OpenAI wire format), engine_loop.py (the one engine thread), metrics.py (Prometheus
text), app.py (the starlette routes), command.py (the CLI subcommand). Nothing here is imported by the core
package: the HTTP stack loads only when serving.
"""
