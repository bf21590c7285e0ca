"""Text in and out through the `tokenizers` package and the target's `tokenizer.json` (both optional)."""
from __future__ import annotations

from pathlib import Path

from cudflash.errors import RequestError


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path) -> Tokenizer | None:
    """None when there is no tokenizer.json or the `tokenizers` package is missing."""
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        return None
    try:
        return Tokenizer(path)
    except ImportError:
        return None
    except Exception as e:  # a corrupt tokenizer.json should not stop token-id use
        raise RequestError(f"{path}: cannot load tokenizer ({e})") from None
