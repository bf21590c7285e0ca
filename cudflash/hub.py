"""Model names: a local folder, or a Hugging Face model id ("Org/Name") resolved through `huggingface_hub`.

An id is looked up in the local Hugging Face cache first (HF_HUB_CACHE / HF_HOME, as huggingface_hub reads
them), and downloaded only when it is not there and the Hub may be reached (HF_HUB_OFFLINE unset).
`huggingface_hub` is optional: it is imported only when a name is not a local folder.
"""
from __future__ import annotations

import re
from pathlib import Path

from cudflash.errors import ConfigError

# What cudflash reads from a model repository: configs, tokenizer files, chat templates, safetensors weights
# (not the .bin / .pt / .gguf / .onnx copies many repositories also carry).
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken"]
# The Hub's own rule for "namespace/name": word characters, '-' and '.', no '--' or '..', at most 96 characters.
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def is_model_id(name: str) -> bool:
    return (len(name) <= 96 and _REPO_ID.fullmatch(name) is not None and "--" not in name and ".." not in name
            and not name.endswith((".", "-")))


def resolve_model(name: str | Path, role: str = "model") -> Path:
    """The folder that holds model `name`: `name` itself when it is a folder (or not a model id: the config
    loader then says what is wrong with the path), else the snapshot of the Hub model id `name`."""
    path = Path(name)
    if isinstance(name, Path) or path.is_dir() or not is_model_id(str(name)):
        return path
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.utils import HfHubHTTPError, LocalEntryNotFoundError
    except ImportError:
        raise ConfigError(f"{name}: not a local directory; to load it as a Hugging Face model id, "
                          "`pip install huggingface_hub`") from None
    try:
        return Path(snapshot_download(str(name), local_files_only=True, allow_patterns=MODEL_FILES))
    except LocalEntryNotFoundError:
        pass  # not in the cache (or only partly): download below, unless offline
    if constants.HF_HUB_OFFLINE:
        raise ConfigError(f"{name}: not a local directory, and the {role} is not in the Hugging Face cache "
                          f"({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is set")
    try:
        return Path(snapshot_download(str(name), allow_patterns=MODEL_FILES))
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:  # offline, unknown, gated, ...
        reason = (str(e).strip().splitlines() or [""])[0][:200]
        raise ConfigError(f"{name}: not a local directory, and downloading the {role} from the Hugging Face Hub "
                          f"failed ({type(e).__name__}: {reason})") from None
