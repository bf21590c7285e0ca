"""Drafter configs: every published descendant of DFlash, in each of its config dialects, validated against
its target.

- DFlash `block_size` at the top level (DFlash-1) or inside `dflash_config` (DFlash2 releases).
- `target_layer_ids` / `mask_token_id` inside `dflash_config`, with the reference's default layer rule.
- The drafter family from `architectures` and `dflash_config.projector_type`: DFlash, DFlash2 (dynamic conv and
  path selector, fields in `dflash_config`), DSpark in both of its dialects: DeepSpec-native `Qwen3DSparkModel`
  (head fields at the top level, no projector_type) and the nested one (`DSparkDraftModel` or projector_type
  "dspark", head fields inside `dflash_config`). Both DSpark dialects parse to the same `DraftConfig`.
- A smaller drafter vocabulary (`draft_vocab_size`, remapped through the checkpoint's `d2t` tensor).
- Sliding-window layers: `layer_types` with `sliding_window`, or `use_swa` with `swa_window_size` (DSpark / MiMo
  exports, nested or at the top level); without `layer_types`, Qwen3Config's own rule (`use_sliding_window`,
  `max_window_layers`). Per layer, whether the block attends causally: z-lab's rule (a `sliding_attention` layer is
  causal unless `is_causal` / `dflash_config.causal` says otherwise).
- The nested block is `dflash_config`, or `dspark_config` (DSpark exports of SGLang / vLLM / TensorRT-LLM lineage).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from cudflash.config import (
    DRAFT_ARCHITECTURES,
    PROJECTOR_TYPES,
    TARGET_ARCHITECTURES,
    MAX_LAYERS,
    MAX_POSITIONS,
    MAX_VOCAB,
    RopeConfig,
    TargetConfig,
    _architectures,
    _bool,
    _check_mlp,
    _int,
    _str,
    read_config_json,
    transformer_dims,
)
from cudflash.errors import ConfigError
from cudflash.model_files import shown

MAX_BLOCK_SIZE = 256  # rows of one draft block (released drafters use 7 to 16)
MAX_HEAD_RANK = 1 << 16  # selector / Markov ranks, conv taps and groups


@dataclass(slots=True)
class DraftConfig:
    path: str
    kind: str  # dflash
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    attention_bias: bool
    block_size: int
    target_layer_ids: list[int]
    mask_token_id: int
    vocab_size: int | None
    # Per drafter layer: 0 for full attention, else the sliding window (in tokens) over the context.
    layer_windows: list[int] = field(default_factory=list)
    # Per drafter layer: the block's rows attend causally among themselves (row j sees block rows 0..j and the whole
    # context); False: every block row sees every block row (the DFlash default).
    layer_causal: list[bool] = field(default_factory=list)
    num_target_layers: int | None = None  # depth of the target it was trained for, when the config says
    shifted_rows: bool = False  # DSpark: every block row, the anchor's included, predicts the NEXT position
    conv_kernel_size: int = 0  # DFlash2 dynamic depthwise conv around each sublayer: taps (0 = none)
    conv_group_size: int = 0  # channels sharing one dynamic coefficient
    selector_rank: int = 0  # DFlash2 path selector: codebook rank (0 = none)
    selector_top_k: int = 0  # candidates per row
    markov_rank: int = 0  # DSpark vanilla Markov head: rank of the bigram bias W2 W1[prev] (0 = none)
    confidence_head: bool = False  # DSpark per-row acceptance predictor
    confidence_with_markov: bool = False  # its input is [h ; W1[prev]] rather than h
    draft_vocab_size: int | None = None  # smaller drafter vocabulary: own lm_head + d2t remap (None = target's)


MAX_TREE_BUDGET = 256  # nodes per tree: the drafter's top-k per position is at most this (and the CUDA top-k's 128)


@dataclass(slots=True)
class DraftOptions:
    """Run-time drafting choices. None changes what is generated: verification keeps every one lossless."""

    sliding_window: int | None = None  # replaces the checkpoint's window on its sliding layers (0 = full attention)
    context_window: int | None = None  # bounds every drafter layer's span over the context (long prompts)
    confidence_threshold: float = 0.0  # DSpark: cut each draft at its first row with confidence below this (0 = off)
    adaptive: bool = False  # DSpark: pick verify lengths from cumulative confidence against the batch's verify cost
    verify_cost: float = 0.05  # adaptive: cost of one verified token, relative to the fixed cost of a step
    tree_budget: int | None = None  # verify a draft tree of at most this many nodes per step (engine/tree.py)

    def __post_init__(self) -> None:
        if self.sliding_window is not None and (isinstance(self.sliding_window, bool)
                                                or not isinstance(self.sliding_window, int) or self.sliding_window < 0):
            raise ConfigError(f"draft sliding window must be an integer >= 0, got {self.sliding_window!r}")
        if self.context_window is not None and (isinstance(self.context_window, bool)
                                                or not isinstance(self.context_window, int) or self.context_window < 1):
            raise ConfigError(f"draft context window must be an integer >= 1, got {self.context_window!r}")
        if not 0.0 <= self.confidence_threshold < 1.0:
            raise ConfigError(f"confidence threshold must be in [0, 1), got {self.confidence_threshold}")
        if not self.verify_cost >= 0.0:
            raise ConfigError(f"verify cost must be >= 0, got {self.verify_cost}")
        if self.tree_budget is not None and (isinstance(self.tree_budget, bool) or not isinstance(self.tree_budget, int)
                                             or not 1 <= self.tree_budget <= MAX_TREE_BUDGET):
            raise ConfigError(f"tree budget must be an integer in 1..{MAX_TREE_BUDGET}, got {self.tree_budget!r}")
        if self.tree_budget is not None and self.uses_confidence:
            raise ConfigError("a tree budget and DSpark's confidence cuts do not combine (a tree already chooses "
                              "what to verify)")

    @property
    def uses_confidence(self) -> bool:
        return self.confidence_threshold > 0.0 or self.adaptive


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The reference rule: evenly spaced from layer 1 to layer N-3 (one layer: the middle one)."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _one_of(dcfg: dict, cfg: dict, key: str) -> Any:
    """`dflash_config.<key>`, else top-level `<key>`: the nested value overrides (DFlash2 exports carry both)."""
    nested = dcfg.get(key)
    return nested if nested is not None else cfg.get(key)


def _where(dcfg: dict, key: str) -> str:
    """The field's name as the config spells it."""
    if dcfg.get(key) is None:
        return key
    return f"{getattr(dcfg, 'blocks', {}).get(key, 'dflash_config')}.{key}"


NESTED_BLOCKS = ("dflash_config", "dspark_config")


class _Nested(dict):
    """The nested drafter fields, from `dflash_config` and / or `dspark_config` (SGLang's and vLLM's DSpark readers
    take the latter); `blocks` says which block each field came from, for messages."""

    blocks: dict[str, str]


def _nested_fields(cfg: dict, path: str) -> _Nested:
    """`dflash_config` and `dspark_config` as one block; a field both give must agree (which would win is not
    defined by any reader)."""
    out = _Nested()
    out.blocks = {}
    for name in NESTED_BLOCKS:
        block = cfg.get(name)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ConfigError(f"{path}: field '{name}' should be an object, got {shown(block)}")
        for key, value in block.items():
            if key in out and value is not None and out[key] is not None and out[key] != value:
                raise ConfigError(f"{path}: {out.blocks[key]}.{key} {shown(out[key])} and {name}.{key} "
                                  f"{shown(value)} disagree")
            if value is not None or key not in out:
                out[key], out.blocks[key] = value, name
    return out


def _nested_int(dcfg: dict, cfg: dict, key: str, path: str, default: Any = 0, minimum: int = 0,
                maximum: int = MAX_HEAD_RANK) -> Any:
    """An integer field read with `_one_of` (nested `dflash_config` first), named in errors as it is spelled."""
    return _int({key: _one_of(dcfg, cfg, key)}, key, path, default=default, minimum=minimum, label=_where(dcfg, key),
                maximum=maximum)


def _nested_bool(dcfg: dict, cfg: dict, keys: tuple[str, ...], path: str, default: bool) -> bool:
    for key in keys:
        value = _one_of(dcfg, cfg, key)
        if value is not None:
            return _bool({key: value}, key, path, default, label=_where(dcfg, key))
    return default


def _draft_kind(cfg: dict, dcfg: dict, path: str) -> str:
    """Which family the checkpoint belongs to: its architecture, refined by projector_type and by head fields."""
    if cfg.get("speculators_model_type") is not None:
        raise ConfigError(
            f"{path}: speculators flat format (speculators_model_type {shown(cfg['speculators_model_type'])}) is not "
            "supported; convert it to the Hugging Face form with a 'dflash_config' block"
        )
    archs = _architectures(cfg, path)
    kind = next((DRAFT_ARCHITECTURES[a] for a in archs if a in DRAFT_ARCHITECTURES), None)
    if kind is None:
        hint = " (that is a target model, not a drafter)" if any(a in TARGET_ARCHITECTURES for a in archs) else ""
        raise ConfigError(
            f"{path}: unknown drafter architecture {shown(archs or 'none given')}{hint} "
            f"(supported: {', '.join(DRAFT_ARCHITECTURES)})"
        )
    projector = _str(dcfg, "projector_type", path, None, label="dflash_config.projector_type")
    if projector is not None:
        if projector not in PROJECTOR_TYPES:
            raise ConfigError(f"{path}: unsupported dflash_config.projector_type {shown(projector)} "
                              f"(supported: {', '.join(PROJECTOR_TYPES)})")
        if kind != "dflash" and PROJECTOR_TYPES[projector] != kind:
            raise ConfigError(f"{path}: dflash_config.projector_type {shown(projector)} contradicts architecture "
                              f"{shown(archs[0])}")
        kind = PROJECTOR_TYPES[projector]
    if kind == "dflash":
        # A DFlashDraftModel export carrying DSpark heads is DSpark (Markov / confidence heads exist only there);
        # one carrying the conv or selector is DFlash2, as the serving engines read it.
        if _one_of(dcfg, cfg, "markov_rank") or _one_of(dcfg, cfg, "enable_confidence_head") \
                or _one_of(dcfg, cfg, "use_confidence_head"):
            kind = "dspark"
        elif _one_of(dcfg, cfg, "conv_kernel_size") or _one_of(dcfg, cfg, "selector_rank"):
            kind = "dflash2"
    return kind


def _draft_heads(cfg: dict, dcfg: dict, path: str, kind: str, hidden: int) -> dict[str, Any]:
    """The DFlash2 / DSpark head settings as DraftConfig fields; anything unsupported is an error, never dropped."""
    out: dict[str, Any] = {}
    conv = _nested_int(dcfg, cfg, "conv_kernel_size", path, maximum=MAX_BLOCK_SIZE)
    rank = _nested_int(dcfg, cfg, "selector_rank", path)
    markov = _nested_int(dcfg, cfg, "markov_rank", path)
    if kind == "dflash2":
        if not conv and not rank:
            raise ConfigError(f"{path}: DFlash2 drafter declares neither 'dflash_config.conv_kernel_size' nor "
                              "'dflash_config.selector_rank'")
        if conv:
            group = _nested_int(dcfg, cfg, "conv_group_size", path, default=None, minimum=1)
            if group is None:
                raise ConfigError(f"{path}: missing field 'dflash_config.conv_group_size' (conv_kernel_size {conv})")
            if hidden % group:
                raise ConfigError(f"{path}: conv_group_size {group} does not divide hidden_size {hidden}")
            out.update(conv_kernel_size=conv, conv_group_size=group)
        if rank:
            top_k = _nested_int(dcfg, cfg, "selector_top_k", path, default=None, minimum=1, maximum=MAX_VOCAB)
            if top_k is None:
                raise ConfigError(f"{path}: missing field 'dflash_config.selector_top_k' (selector_rank {rank})")
            out.update(selector_rank=rank, selector_top_k=top_k)
    elif conv or rank:
        raise ConfigError(f"{path}: conv_kernel_size / selector_rank (DFlash2 fields) on a {kind} drafter")
    if kind == "dspark":
        if not _nested_bool(dcfg, cfg, ("shift_label",), path, True):
            raise ConfigError(f"{path}: DSpark with shift_label false is not supported (DSpark rows are shifted)")
        head_type = _str({"t": _one_of(dcfg, cfg, "markov_head_type")}, "t", path, "vanilla",
                         label=_where(dcfg, "markov_head_type")).lower()
        if markov and head_type != "vanilla":
            raise ConfigError(f"{path}: Markov head type {head_type!r} is not supported (only 'vanilla')")
        confidence = _nested_bool(dcfg, cfg, ("enable_confidence_head", "use_confidence_head"), path, False)
        with_markov = confidence and _nested_bool(dcfg, cfg, ("confidence_head_with_markov",), path, True)
        if with_markov and not markov:
            raise ConfigError(f"{path}: confidence_head_with_markov needs a Markov head (markov_rank is 0)")
        out.update(shifted_rows=True, markov_rank=markov, confidence_head=confidence,
                   confidence_with_markov=with_markov)
    elif markov:
        raise ConfigError(f"{path}: markov_rank (a DSpark field) on a {kind} drafter")
    _check_logit_fields(cfg, dcfg, path)
    return out


# Fields of z-lab's reference (dflash/model.py: `input_embedding_scale` scales the block's embedding,
# `output_multiplier` and `final_logit_softcapping` reshape the drafter's logits) that cudflash does not apply: a
# value other than the neutral one would change the drafts, so it is refused rather than ignored.
NEUTRAL_FIELDS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def _check_logit_fields(cfg: dict, dcfg: dict, path: str) -> None:
    for key, neutral in NEUTRAL_FIELDS.items():
        value = _one_of(dcfg, cfg, key)
        if value is None or value == neutral or (key == "final_logit_softcapping" and value == 0):
            continue
        raise ConfigError(f"{path}: {_where(dcfg, key)} {shown(value)} is not supported (cudflash drafts with the "
                          f"reference's neutral value, {neutral})")


def _layer_types(cfg: dict, path: str, num_layers: int, swa: int | None) -> tuple[list[str], bool]:
    """The drafter's layer types, and whether the config spelled them out. Without `layer_types`: every layer
    sliding under `use_swa`; else Qwen3Config's own rule (the drafters are `model_type: qwen3`, and z-lab's reference
    reads the layer types that rule fills in): with `use_sliding_window` true, layers from `max_window_layers`
    (default 28) on are sliding."""
    types = cfg.get("layer_types") or None  # [] as absent, as before
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            n = len(types) if isinstance(types, list) else shown(types)
            raise ConfigError(f"{path}: 'layer_types' has {n} entries, expected {num_layers} (num_hidden_layers)")
        return list(types), True
    if swa is not None:
        return ["sliding_attention"] * num_layers, False
    if _bool(cfg, "use_sliding_window", path, False) and cfg.get("sliding_window") is not None:
        first = _int(cfg, "max_window_layers", path, default=28, minimum=0, maximum=MAX_LAYERS)
        return ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)], False
    return ["full_attention"] * num_layers, False


def _layer_windows(cfg: dict, dcfg: dict, path: str, num_layers: int, kind: str) -> tuple[list[int], list[bool]]:
    """Per drafter layer, 0 (full attention) or its sliding window over the context, in tokens (a query at
    position p sees keys j with p - window < j; HF's flash path runs a window W as W - 1 keys either side), and
    whether its block rows attend causally.

    Windows come in two dialects: `layer_types` with the model's `sliding_window`; or (DSpark / MiMo exports)
    `use_swa` with `swa_window_size`, which covers the layers `layer_types` marks sliding, or every layer where
    there is no `layer_types` (as TensorRT-LLM's DSpark loader reads it). `use_sliding_window: false` beside
    sliding layers drops their window, as Qwen3Config does (`sliding_window = None` unless use_sliding_window) and
    so z-lab's reference and vLLM; absent, the window applies (every released sliding drafter sets it true). A
    drafter trained with its window loses most of its acceptance without it (docs/drafters.md, section 5), so a
    window that is asked for and cannot be resolved is an error.

    Causality: `is_causal` (top level), else `dflash_config.causal`, for every layer; else, for the z-lab families
    (DFlash, DFlash2), z-lab's rule `is_causal = layer_type == "sliding_attention"` (dflash/model.py; vLLM's
    DFlash reads it the same way); DSpark layers stay bidirectional unless the config says otherwise."""
    swa = None
    if _nested_bool(dcfg, cfg, ("use_swa",), path, default=False):
        swa = _nested_int(dcfg, cfg, "swa_window_size", path, default=None, minimum=1, maximum=MAX_POSITIONS)
        if swa is None:
            raise ConfigError(f"{path}: 'use_swa' is set but 'swa_window_size' is missing")
    layer_types, spelled = _layer_types(cfg, path, num_layers, swa)
    window_off = swa is None and cfg.get("use_sliding_window") is False
    windows = []
    for t in layer_types:
        if t == "full_attention":
            windows.append(0)
        elif t != "sliding_attention":
            raise ConfigError(
                f"{path}: unknown layer type {shown(t)} in 'layer_types' (expected full_attention or sliding_attention)"
            )
        elif window_off:
            windows.append(0)
        elif swa is None:
            windows.append(_int(cfg, "sliding_window", path, maximum=MAX_POSITIONS))
        else:
            model_window = _int(cfg, "sliding_window", path, default=None, maximum=MAX_POSITIONS)
            if model_window is not None and model_window != swa:
                raise ConfigError(f"{path}: 'swa_window_size' {swa} disagrees with 'sliding_window' {model_window}")
            windows.append(swa)
    if cfg.get("is_causal") is not None:
        causal = [_bool(cfg, "is_causal", path, False)] * num_layers
    elif dcfg.get("causal") is not None:
        causal = [_bool(dcfg, "causal", path, False, label=_where(dcfg, "causal"))] * num_layers
    elif kind in ("dflash", "dflash2") and (spelled or swa is None):
        causal = [t == "sliding_attention" for t in layer_types]
    else:
        causal = [False] * num_layers
    return windows, causal


def _target_layer_ids(cfg: dict, dcfg: dict, path: str, num_target_layers: int | None,
                      num_layers: int) -> list[int]:
    """Explicit, else by the reference's default rule; each a layer index of the target (checked against the
    target itself in validate_pair)."""
    layer_ids = _one_of(dcfg, cfg, "target_layer_ids")
    if layer_ids is None:
        if num_target_layers is None:
            raise ConfigError(f"{path}: missing 'dflash_config.target_layer_ids' (and no 'num_target_layers')")
        layer_ids = default_target_layer_ids(num_target_layers, num_layers)
    label = _where(dcfg, "target_layer_ids")
    if (not isinstance(layer_ids, list) or not 0 < len(layer_ids) <= MAX_LAYERS
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in layer_ids)):
        raise ConfigError(f"{path}: '{label}' should be a non-empty list of at most {MAX_LAYERS} integers, got "
                          f"{shown(layer_ids)}")
    depth = num_target_layers or MAX_LAYERS
    bad = next((i for i in layer_ids if not 0 <= i < depth), None)
    if bad is not None:
        known = f"the target's {num_target_layers} layers (num_target_layers)" if num_target_layers else "any target"
        raise ConfigError(f"{path}: '{label}' entry {bad} is outside {known}")
    return list(layer_ids)


def load_draft_config(model_dir: str | Path) -> DraftConfig:
    model_dir = Path(model_dir)
    cfg = read_config_json(model_dir)
    path = str(model_dir / "config.json")
    dcfg = _nested_fields(cfg, path)
    kind = _draft_kind(cfg, dcfg, path)
    dims = transformer_dims(cfg, path)
    _check_mlp(cfg, path)

    block_size = _int({"block_size": _one_of(dcfg, cfg, "block_size")}, "block_size", path,
                      default=None, label=_where(dcfg, "block_size"), maximum=MAX_BLOCK_SIZE)
    if block_size is None:
        raise ConfigError(f"{path}: missing field 'block_size' (top level or in 'dflash_config')")
    num_target_layers = _int(cfg, "num_target_layers", path, default=None, maximum=MAX_LAYERS)
    layer_ids = _target_layer_ids(cfg, dcfg, path, num_target_layers, dims["num_layers"])

    vocab = _int(cfg, "vocab_size", path, default=None, maximum=MAX_VOCAB)
    mask = _one_of(dcfg, cfg, "mask_token_id")
    if mask is None:
        raise ConfigError(f"{path}: missing field 'dflash_config.mask_token_id'")
    mask = _int({"m": mask}, "m", path, minimum=0, label=_where(dcfg, "mask_token_id"),
                maximum=(vocab or MAX_VOCAB) - 1)
    draft_vocab = _nested_int(dcfg, cfg, "draft_vocab_size", path, default=None, minimum=1,
                              maximum=vocab or MAX_VOCAB)

    windows, causal = _layer_windows(cfg, dcfg, path, dims["num_layers"], kind)
    dc = DraftConfig(
        path=str(model_dir),
        kind=kind,
        **dims,
        max_position_embeddings=_int(cfg, "max_position_embeddings", path, default=0, maximum=MAX_POSITIONS),
        attention_bias=_bool(cfg, "attention_bias", path, False),
        block_size=block_size,
        target_layer_ids=layer_ids,
        mask_token_id=mask,
        vocab_size=vocab,
        layer_windows=windows,
        layer_causal=causal,
        num_target_layers=num_target_layers,
        draft_vocab_size=None if draft_vocab == vocab else draft_vocab,  # the full vocabulary: nothing to remap
        **_draft_heads(cfg, dcfg, path, kind, dims["hidden_size"]),
    )
    return dc


def apply_draft_options(dc: DraftConfig, opts: DraftOptions) -> DraftConfig:
    """The drafter config as this run uses it: the checkpoint's values unless an option overrides them."""
    if opts.sliding_window is not None:
        if not any(dc.layer_windows):
            raise ConfigError(f"{dc.path}/config.json: drafter declares no sliding_attention layers; a sliding-window "
                              "override applies only to those")
        dc = replace(dc, layer_windows=[opts.sliding_window if w else 0 for w in dc.layer_windows])
    if opts.context_window is not None:  # the tighter of the layer's own window and the bound
        cw = opts.context_window
        dc = replace(dc, layer_windows=[min(w, cw) if w else cw for w in dc.layer_windows])
    if opts.tree_budget is not None and (dc.kind == "dspark" or dc.markov_rank or dc.shifted_rows):
        raise ConfigError(f"{dc.path}/config.json: tree verification takes DFlash and DFlash2 drafters; this is a "
                          f"{dc.kind} drafter (its Markov walk drafts one path)")
    if opts.uses_confidence and not dc.confidence_head:
        raise ConfigError(f"{dc.path}/config.json: a confidence threshold or adaptive verify needs a drafter with a "
                          f"confidence head (this {dc.kind} drafter has none)")
    return dc


def validate_pair(target: TargetConfig, draft: DraftConfig) -> None:
    """A drafter borrows the target's embedding, LM head and hidden states: their shapes must agree."""
    where = f"{draft.path}/config.json vs {target.path}/config.json"
    if draft.hidden_size != target.hidden_size:
        raise ConfigError(f"{where}: drafter hidden_size {draft.hidden_size} != target hidden_size {target.hidden_size}")
    if draft.vocab_size is not None and draft.vocab_size != target.vocab_size:
        raise ConfigError(f"{where}: drafter vocab_size {draft.vocab_size} != target vocab_size {target.vocab_size}")
    if draft.num_target_layers is not None and draft.num_target_layers != target.num_layers:
        raise ConfigError(
            f"{where}: drafter num_target_layers {draft.num_target_layers} != target num_hidden_layers "
            f"{target.num_layers} (drafter trained for a different target)"
        )
    for i in draft.target_layer_ids:
        if not 0 <= i < target.num_layers:
            raise ConfigError(
                f"{where}: drafter target_layer_ids entry {i} outside the target's {target.num_layers} layers "
                f"(0..{target.num_layers - 1})"
            )
    if draft.draft_vocab_size is not None and draft.draft_vocab_size > target.vocab_size:
        raise ConfigError(f"{where}: drafter draft_vocab_size {draft.draft_vocab_size} > target vocab_size "
                          f"{target.vocab_size}")
    if draft.selector_top_k > (draft.draft_vocab_size or target.vocab_size):
        raise ConfigError(f"{where}: drafter selector_top_k {draft.selector_top_k} exceeds its vocabulary")
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise ConfigError(
            f"{where}: drafter mask_token_id {draft.mask_token_id} outside the target vocabulary "
            f"(vocab_size {target.vocab_size})"
        )
