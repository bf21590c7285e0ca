"""Text in and out through the `tokenizers` package and the target's `tokenizer.json` (both optional)."""
from __future__ import annotations

from pathlib import Path

from cudflash.errors import RequestError


class Tokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer as HFTokenizer

        self._tok = HFTokenizer.from_file(str(path))

    def encode(self, text: str, special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. `special_tokens`: with the tokens tokenizer.json's post-processor puts around a text
        (Llama 3's `<|begin_of_text|>`; none for Qwen), as transformers and vLLM encode a plain prompt; False for a
        rendered chat template, which already holds every special token its model wants."""
        return self._tok.encode(text, add_special_tokens=special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def decode_delta(self, ids: list[int], prefix_offset: int, read_offset: int,
                     final: bool = False) -> tuple[str, int, int]:
        """Text that ids[read_offset:] add, decoding only a short window instead of the whole output.

        Tokens before `read_offset` are already text; the window starts at `prefix_offset`, the previous read
        boundary, which is a character boundary. Returns ("", same offsets) while the new tokens end inside a
        multi-byte character (unless `final`: the output ends there), else (delta, read_offset, len(ids)) as the
        next offsets.
        """
        prefix = self.decode(ids[prefix_offset:read_offset])
        full = self.decode(ids[prefix_offset:])
        if not final and (len(full) <= len(prefix) or full.endswith("\ufffd")):
            return "", prefix_offset, read_offset
        return full[len(prefix):], read_offset, len(ids)


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
