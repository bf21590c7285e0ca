"""Which quantized format a checkpoint declares: `quantization_config` in config.json, or ModelOpt's
hf_quant_config.json. Every other format or variant is refused here, by name, before any tensor is read.

Read (docs/quantization.md has the sources):
- `quant_method: fp8` with `weight_block_size` [rows, cols] (Qwen's -FP8 releases, DeepSeek-V3), `fmt: e4m3`,
  `activation_scheme: dynamic`; `modules_to_not_convert` (or vLLM's `ignored_layers`). Without `weight_block_size`:
  AutoFP8's per-tensor layout (neuralmagic's first -FP8 releases), one `weight_scale` per module, activations dynamic
  or static (`input_scale`, recorded), as vLLM's Fp8Config reads it.
- `quant_method: compressed-tensors`, `format: float-quantized` or `naive-quantized`, whose `config_groups` all
  quantize weights to 8-bit floats (`strategy` channel, tensor or block); `ignore`. Older releases are read as
  transformers reads them: `quantization_status: frozen` (what compressed-tensors before 0.7 wrote into checkpoints it
  had compressed), the fields nested one level down in a `quantization_config` beside `sparsity_config`, and a
  `sparsity_config` whose format is `dense` (the identity: the weights are stored as they are). Or `format:
  nvfp4-pack-quantized` (llm-compressor's NVFP4 / NVFP4A16), whose groups all quantize weights to 4-bit floats with
  `strategy: tensor_group`, `group_size: 16` (activations none, or the W4A4 scheme's 4-bit floats: recorded).
- ModelOpt: `quant_algo: NVFP4`, `group_size: 16`, or `quant_algo: FP8` (per-tensor E4M3 weights with a static
  per-tensor input scale: nvidia's -FP8 exports); `exclude_modules` (or `ignore`), in hf_quant_config.json's
  `quantization` or in config.json's `quantization_config` with `quant_method: modelopt`.
The excluded-module lists are recorded, not used to pick tensors: a tensor is read as quantized when the checkpoint
stores it so (its dtype and its scale tensor), and as it is otherwise. Activation scales (static `input_scale`) and
KV-cache scales are recorded and unused: the engine computes with bf16 activations (W8A16 / W4A16) and a bf16 KV
cache, which is the quantized weights' own model with less rounding than the W8A8 / W4A4 the scales were made for.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cudflash.config import read_config_json, read_json_file
from cudflash.errors import ConfigError
from cudflash.model_files import shown

HF_QUANT_CONFIG = "hf_quant_config.json"
SUPPORTED = ("fp8 (block-scaled as the Qwen -FP8 releases, or AutoFP8's per-tensor), compressed-tensors FP8 "
             "(float-quantized: channel, tensor or block scales) and NVFP4 (nvfp4-pack-quantized), ModelOpt NVFP4 and "
             "FP8")
MODELOPT_ALGOS = ("NVFP4", "FP8")
CT_FORMATS = ("float-quantized", "naive-quantized")
CT_NVFP4 = "nvfp4-pack-quantized"
CT_STRATEGIES = ("channel", "tensor", "block")


@dataclass(frozen=True)
class QuantScheme:
    # "fp8" (block-scaled, weight_scale_inv) | "fp8-tensor" (AutoFP8 per-tensor: weight_scale) | "compressed-tensors"
    # (FP8 or NVFP4: `weights`) | "nvfp4" (ModelOpt) | "modelopt-fp8" (ModelOpt per-tensor FP8: weight_scale)
    method: str
    source: str  # the file that declared it, for messages
    block: tuple[int, int] | None = None  # fp8: weight_block_size; compressed-tensors: the block strategy's
    strategies: tuple[str, ...] = ()  # compressed-tensors: the weight strategies its groups use
    exclude: tuple[str, ...] = ()  # modules declared unquantized (recorded)
    static_activations: bool = False  # the checkpoint has input_scale tensors (recorded, unused)
    kv_cache: str | None = None  # its KV-cache quantization (k_scale / v_scale unused: the KV cache stays bf16)
    weights: str = "fp8"  # compressed-tensors: "fp8" or "nvfp4", what its groups quantize the weights to

    @property
    def format(self) -> str:
        """The QuantizedWeight format its tensors load as."""
        return "nvfp4" if self.method == "nvfp4" or self.weights == "nvfp4" else "fp8"

    @property
    def scale_name(self) -> str:
        return "weight_scale_inv" if self.method == "fp8" else "weight_scale"


def _names(value: Any, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{where} should be a list of module names, got {shown(value)}")
    return tuple(value)


def _block(value: Any, where: str) -> tuple[int, int]:
    if not (isinstance(value, list) and len(value) == 2 and
            all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= 1 << 16 for v in value)):
        raise ConfigError(f"{where} should be [rows, cols], two positive integers, got {shown(value)}")
    return value[0], value[1]


def read_quant_scheme(model_dir: str | Path) -> QuantScheme | None:
    """The checkpoint's quantization (None: it declares none), or a ConfigError naming the file, the field and the
    value of anything cudflash does not read."""
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    cfg = read_config_json(model_dir)
    qc = cfg.get("quantization_config")
    if qc is None and isinstance(cfg.get("text_config"), dict):  # multimodal wrappers may nest it
        qc = cfg["text_config"].get("quantization_config")
    hf_path = model_dir / HF_QUANT_CONFIG
    modelopt = None
    if hf_path.is_file() or hf_path.is_symlink():
        doc = read_json_file(hf_path, model_dir)
        modelopt = doc.get("quantization") if isinstance(doc, dict) else None
        if not isinstance(modelopt, dict):
            raise ConfigError(f"{hf_path}: expected an object with a 'quantization' object, got {shown(doc)}")
    if qc is None:
        return _modelopt(modelopt, str(hf_path)) if modelopt is not None else None
    where = f"{config_path}: field 'quantization_config"
    if not isinstance(qc, dict):
        raise ConfigError(f"{where}' should be an object, got {shown(qc)}")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError(f"{where}.quant_method' is missing or not a string ({shown(method)}); cudflash reads "
                          f"{SUPPORTED}")
    if modelopt is not None and method != "modelopt":
        raise ConfigError(f"{hf_path}: a ModelOpt quantization beside quant_method {shown(method)} in {config_path} "
                          f"(which one is the checkpoint?)")
    if method == "fp8":
        return _fp8(qc, where, str(config_path))
    if method == "compressed-tensors":
        return _compressed_tensors(qc, where, str(config_path))
    if method == "modelopt":
        if modelopt is not None:
            algo_here, algo_there = _algo(qc), _algo(modelopt)
            if algo_here is not None and algo_here != algo_there:
                raise ConfigError(f"{where}.quant_algo' is {shown(algo_here)} but {hf_path} says {shown(algo_there)}")
            return _modelopt(modelopt, str(hf_path))
        return _modelopt(qc, str(config_path), where)
    raise ConfigError(f"{where}.quant_method' is {shown(method)}: not supported (cudflash reads {SUPPORTED})")


def _fp8(qc: dict, where: str, source: str) -> QuantScheme:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{where}.fmt' is {shown(fmt)}: only e4m3 FP8 weights are supported")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ConfigError(f"{where}.activation_scheme' is {shown(scheme)}: expected 'dynamic' or 'static'")
    exclude = _names(qc.get("modules_to_not_convert"), f"{where}.modules_to_not_convert'")
    exclude += _names(qc.get("ignored_layers"), f"{where}.ignored_layers'")
    if qc.get("weight_block_size") is None:
        # AutoFP8 (vLLM's Fp8Config without block_quant): `<m>.weight` E4M3 and one `<m>.weight_scale` that multiplies;
        # a static scheme adds `<m>.input_scale` (recorded: cudflash computes with bf16 activations).
        return QuantScheme("fp8-tensor", source, strategies=("tensor",), exclude=exclude,
                           static_activations=scheme == "static")
    block = _block(qc["weight_block_size"], f"{where}.weight_block_size'")
    if scheme != "dynamic":
        raise ConfigError(f"{where}.activation_scheme' is {shown(scheme)}: block-scaled FP8 is defined with dynamic "
                          f"activations only (as vLLM and transformers read it)")
    return QuantScheme("fp8", source, block=block, exclude=exclude)


def _unnested(qc: dict) -> dict:
    """The fields of a compressed-tensors config: older releases nest them one level down, in a
    `quantization_config` beside `sparsity_config` (transformers' CompressedTensorsConfig.from_dict lifts them)."""
    inner = qc.get("quantization_config")
    if not isinstance(inner, dict):
        return qc
    return {**inner, "quant_method": qc["quant_method"], "sparsity_config": qc.get("sparsity_config")}


def _compressed_tensors(qc: dict, where: str, source: str) -> QuantScheme:
    qc = _unnested(qc)
    fmt = qc.get("format")
    if fmt == CT_NVFP4:
        return _compressed_nvfp4(qc, where, source)
    if fmt not in CT_FORMATS:
        raise ConfigError(f"{where}.format' is {shown(fmt)}: not supported (compressed-tensors FP8 weights are "
                          f"{' or '.join(CT_FORMATS)}, NVFP4 ones {CT_NVFP4}; packed int4 / int8 / sparse formats "
                          f"are not read)")
    _check_compressed(qc, where)
    strategies, block, static = [], None, False
    for name, group in _groups(qc, where).items():
        at = f"{where}.config_groups.{name}"
        if group.get("format") not in (None, *CT_FORMATS):
            raise ConfigError(f"{at}.format' is {shown(group['format'])}: not supported (only FP8 weights)")
        w = group["weights"]
        if w.get("type") != "float" or w.get("num_bits") != 8:
            raise ConfigError(f"{at}.weights' is {shown(w.get('type'))} with {shown(w.get('num_bits'))} bits: only "
                              f"8-bit float (FP8) weights are supported")
        strategy = w.get("strategy")
        if strategy not in CT_STRATEGIES:
            raise ConfigError(f"{at}.weights.strategy' is {shown(strategy)}: FP8 weights with "
                              f"{', '.join(CT_STRATEGIES)} scales are supported")
        if w.get("symmetric", True) is not True or w.get("dynamic", False) is not False or w.get("actorder"):
            raise ConfigError(f"{at}.weights' must be symmetric, static (dynamic: false) and without actorder, got "
                              f"symmetric {shown(w.get('symmetric'))}, dynamic {shown(w.get('dynamic'))}, actorder "
                              f"{shown(w.get('actorder'))}")
        if strategy == "block":
            block = _block(w.get("block_structure"), f"{at}.weights.block_structure'")
        strategies.append(strategy)
        act = group.get("input_activations")
        if act is not None:
            if not isinstance(act, dict) or act.get("type") != "float" or act.get("num_bits") != 8:
                raise ConfigError(f"{at}.input_activations' should be null or 8-bit float, got {shown(act)}")
            static = static or act.get("dynamic") is False
        if group.get("output_activations") is not None:
            raise ConfigError(f"{at}.output_activations' is set: output quantization is not supported")
    kv = qc.get("kv_cache_scheme")
    return QuantScheme("compressed-tensors", source, block=block, strategies=tuple(dict.fromkeys(strategies)),
                       exclude=_names(qc.get("ignore"), f"{where}.ignore'"), static_activations=static,
                       kv_cache=None if kv is None else shown(kv))


# Statuses of a checkpoint saved after compression: "compressed", and "frozen", which compressed-tensors before 0.7
# recorded in checkpoints it had compressed all the same (e.g. nm-testing/Meta-Llama-3.1-8B-Instruct-FP8-hf:
# naive-quantized, F8_E4M3 weights). The tensors' dtypes decide what is read either way.
CT_SAVED_STATUSES = ("compressed", "frozen")


def _check_compressed(qc: dict, where: str) -> None:
    """What every compressed-tensors checkpoint read here must be: saved after compression, without sparse
    compression or transforms."""
    status = qc.get("quantization_status", "compressed")
    if status not in CT_SAVED_STATUSES:
        raise ConfigError(f"{where}.quantization_status' is {shown(status)}: only checkpoints saved compressed "
                          f"({' or '.join(CT_SAVED_STATUSES)}) hold the quantized weights as saved for inference")
    sparsity = qc.get("sparsity_config")
    if sparsity and not (isinstance(sparsity, dict) and sparsity.get("format") == "dense"):
        # "dense" is compressed-tensors' identity sparsity compressor: the weights are stored as they are.
        what = shown(sparsity.get("format")) if isinstance(sparsity, dict) else shown(sparsity)
        raise ConfigError(f"{where}.sparsity_config' has format {what}: compressed-tensors sparse compression is "
                          f"not supported (only 'dense', weights stored as they are)")
    if qc.get("transform_config"):
        raise ConfigError(f"{where}.transform_config' is set: compressed-tensors transforms are not supported")


def _groups(qc: dict, where: str) -> dict:
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ConfigError(f"{where}.config_groups' should be a non-empty object of quantization schemes")
    for name, group in groups.items():
        if not isinstance(group, dict) or not isinstance(group.get("weights"), dict):
            raise ConfigError(f"{where}.config_groups.{name}' should be an object with a 'weights' object")
    return groups


def _compressed_nvfp4(qc: dict, where: str, source: str) -> QuantScheme:
    """compressed-tensors NVFP4 (llm-compressor's NVFP4 and NVFP4A16 schemes): every group's weights 4-bit floats
    in groups of 16 under one global scale (strategy tensor_group); activations none (W4A16) or 4-bit floats (the
    W4A4 scheme's, recorded: cudflash computes with bf16 activations)."""
    _check_compressed(qc, where)
    static = False
    for name, group in _groups(qc, where).items():
        at = f"{where}.config_groups.{name}"
        if group.get("format") not in (None, CT_NVFP4):
            raise ConfigError(f"{at}.format' is {shown(group['format'])} in an {CT_NVFP4} checkpoint: mixed formats "
                              f"are not supported")
        w = group["weights"]
        if w.get("type") != "float" or w.get("num_bits") != 4:
            raise ConfigError(f"{at}.weights' is {shown(w.get('type'))} with {shown(w.get('num_bits'))} bits: "
                              f"{CT_NVFP4} needs 4-bit float weights")
        if w.get("strategy") != "tensor_group" or w.get("group_size") != 16:
            raise ConfigError(f"{at}.weights' has strategy {shown(w.get('strategy'))} and group_size "
                              f"{shown(w.get('group_size'))}: NVFP4 is tensor_group with groups of 16")
        if w.get("symmetric", True) is not True or w.get("dynamic", False) is not False:
            raise ConfigError(f"{at}.weights' must be symmetric and static (dynamic: false)")
        act = group.get("input_activations")
        if act is not None:
            if not isinstance(act, dict) or act.get("type") != "float" or act.get("num_bits") != 4:
                raise ConfigError(f"{at}.input_activations' should be null or 4-bit float, got {shown(act)}")
            static = True  # an input_global_scale per module
        if group.get("output_activations") is not None:
            raise ConfigError(f"{at}.output_activations' is set: output quantization is not supported")
    kv = qc.get("kv_cache_scheme")
    return QuantScheme("compressed-tensors", source, exclude=_names(qc.get("ignore"), f"{where}.ignore'"),
                       static_activations=static, kv_cache=None if kv is None else shown(kv), weights="nvfp4")


def _algo(q: dict) -> Any:
    """ModelOpt's quant_algo, upper-cased: exports may spell it in lower case (vLLM's ModelOpt loader normalizes it
    the same way)."""
    algo = q.get("quant_algo")
    return algo.upper() if isinstance(algo, str) else algo


def _modelopt(q: dict, source: str, where: str | None = None) -> QuantScheme:
    where = where or f"{source}: field 'quantization"
    algo = _algo(q)
    if algo not in MODELOPT_ALGOS:
        raise ConfigError(f"{where}.quant_algo' is {shown(algo)}: not supported (of ModelOpt's formats cudflash "
                          f"reads {' and '.join(MODELOPT_ALGOS)}; {SUPPORTED})")
    exclude = _names(q.get("exclude_modules"), f"{where}.exclude_modules'") + _names(q.get("ignore"),
                                                                                    f"{where}.ignore'")
    kv = q.get("kv_cache_quant_algo")
    kv_cache = None if kv is None else str(kv)
    if algo == "FP8":
        # ModelOpt's FP8 (vLLM ModelOptFp8Config): `<m>.weight` E4M3 with one float32 `<m>.weight_scale` and a static
        # `<m>.input_scale` per module; the scale multiplies. Read as a per-tensor FP8 weight (W8A16 here).
        return QuantScheme("modelopt-fp8", source, strategies=("tensor",), exclude=exclude, static_activations=True,
                           kv_cache=kv_cache)
    group = q.get("group_size", 16)
    if group != 16:
        raise ConfigError(f"{where}.group_size' is {shown(group)}: NVFP4 has one scale per 16 elements")
    return QuantScheme("nvfp4", source, exclude=exclude, static_activations=True, kv_cache=kv_cache)
