"""Huawei AMCT's simplified post-training config (`quant.cfg`, protobuf text format) read
into onnxq's config shape: a dict laid over the preset like any config file.

How each field maps (docs/configuration.md, "Configs from AMCT, Quark and onnxruntime"):
- common_config / override_layer_types / override_layer_configs -> global_quant_config /
  layer_type_quant_config / layer_quant_config; AMCT's priority (layer > type > common >
  activation_offset) is onnxq's field-by-field node > op type > global.
- arq_quantize -> weights, min-max (`channel_wise` -> per_channel or per_tensor,
  `asymmetric`, `quant_bits` 6/7 -> `bits`; in common_config only Conv gets 6/7 bits, as
  in AMCT). ada_quantize -> the same weight settings plus an `adaround` entry that covers
  the layers where ADA is the weight algorithm. Within one block the weight algorithm
  configured last wins (ARQ or ADA); NUQ has no counterpart and is refused.
- ifmr_quantize / hfmg_quantize -> activations with calib_method ifmr / hfmg and their
  options (the one configured last wins); `asymmetric` and `dst_type` pick uint8/int8 or
  uint16/int16. activation_offset -> the global activation asymmetry.
- dmq_balancer -> a `smoothquant` entry with its migration_strength.
- weight_compress_only -> activations left float (weight-only).
- skip_layers -> exclude; skip_layer_types -> op types kept float; do_fusion /
  skip_fusion_layers -> the fold_batchnorm pass; batch_num -> calibration.max_batches;
  tensor_quantize -> that node's input activations.
Anything without a counterpart (NUQ, joint_quant, fakequant_precision_mode other than
DEFAULT) is a one-line error naming the field and line.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

from onnxq.config.prototext import OPAQUE, Field, Message, parse_prototext
from onnxq.errors import ConfigError, closest_name

AMCT_SUFFIXES = (".cfg", ".prototxt", ".pbtxt")
_CALIBRATION = "CalibrationConfig"
SCHEMA: dict[str, dict[str, Field]] = {
    "AMCTConfig": {
        "batch_num": Field("int"),
        "activation_offset": Field("bool"),
        "joint_quant": Field("bool"),
        "enable_auto_nuq": Field("bool"),
        "version": Field("int"),
        "skip_layers": Field("string", True),
        "skip_layer_types": Field("string", True),
        "do_fusion": Field("bool"),
        "skip_fusion_layers": Field("string", True),
        "common_config": Field(_CALIBRATION),
        "override_layer_types": Field("OverrideLayerType", True),
        "override_layer_configs": Field("OverrideLayer", True),
        "tensor_quantize": Field("TensorQuantize", True),
        "nuq_config": Field(OPAQUE),
        "fakequant_precision_mode": Field("enum"),
    },
    "OverrideLayerType": {"layer_type": Field("string"), "calibration_config": Field(_CALIBRATION)},
    "OverrideLayer": {"layer_name": Field("string"), "calibration_config": Field(_CALIBRATION)},
    "TensorQuantize": {
        "layer_name": Field("string"),
        "input_index": Field("int"),
        "ifmr_quantize": Field("FMRQuantize"),
        "hfmg_quantize": Field("HFMGQuantize"),
    },
    _CALIBRATION: {
        "arq_quantize": Field("ARQuantize"),
        "ada_quantize": Field("ADAQuantize"),
        "nuq_quantize": Field(OPAQUE),
        "ifmr_quantize": Field("FMRQuantize"),
        "hfmg_quantize": Field("HFMGQuantize"),
        "dmq_balancer": Field("DMQBalancer"),
        "weight_compress_only": Field("bool"),
    },
    "ARQuantize": {
        "channel_wise": Field("bool"), "asymmetric": Field("bool"), "quant_bits": Field("int"),
        "num_bits": Field("int"),
    },
    "ADAQuantize": {
        "num_iteration": Field("int"), "reg_param": Field("float"), "beta_range_start": Field("float"),
        "beta_range_end": Field("float"), "warm_start": Field("float"), "channel_wise": Field("bool"),
    },
    "FMRQuantize": {
        "search_range_start": Field("float"), "search_range_end": Field("float"),
        "search_step": Field("float"), "max_percentile": Field("float"), "min_percentile": Field("float"),
        "asymmetric": Field("bool"), "dst_type": Field("enum"), "num_bits": Field("int"),
    },
    "HFMGQuantize": {"num_of_bins": Field("int"), "asymmetric": Field("bool"), "dst_type": Field("enum")},
    "DMQBalancer": {"migration_strength": Field("float")},
}
WEIGHT_ALGORITHMS = ("arq_quantize", "ada_quantize", "nuq_quantize")
ACTIVATION_ALGORITHMS = ("ifmr_quantize", "hfmg_quantize")
IFMR_OPTIONS = ("search_range_start", "search_range_end", "search_step", "max_percentile", "min_percentile")
ADA_OPTIONS = ("num_iteration", "reg_param", "beta_range_start", "beta_range_end", "warm_start")
ADA_TYPES = ("Conv", "Gemm", "MatMul")
KEEP_FLOAT = {tc: {"dtype": "float32"} for tc in ("input_tensors", "output_tensors", "weight", "bias")}
_TOP_FIELDS = re.compile(r"^\s*(common_config|override_layer_types|override_layer_configs|activation_offset|"
                         r"skip_layer_types|skip_layers|batch_num|do_fusion|joint_quant|tensor_quantize)\s*[:{]",
                         re.MULTILINE)


def looks_like_amct(text: str) -> bool:
    """Whether a config file of unknown suffix reads as an AMCT simplified config."""
    return bool(_TOP_FIELDS.search(text)) and "global_quant_config" not in text


def read_amct(text: str, path: Path) -> dict[str, Any]:
    """The onnxq config dict (over the default preset) an AMCT `.cfg` text describes."""
    where = str(path)
    return _Translation(parse_prototext(text, SCHEMA, "AMCTConfig", where), where).run()


class _Translation:
    """One pass over a parsed AMCTConfig; collects the algorithm entries as it goes."""

    def __init__(self, root: Message, where: str) -> None:
        self.root = root
        self.where = where
        self.offset = root.get("activation_offset", True)
        self.ada: list[tuple[str, str | None, Message, int]] = []  # (level, key, options, line)
        self.arq: list[tuple[str, str | None]] = []
        self.dmq: list[tuple[str, str | None, float, int]] = []

    def refuse(self, line: int, message: str) -> ConfigError:
        return ConfigError(f"{self.where}: line {line}: {message}")

    def run(self) -> dict[str, Any]:
        root = self.root
        self._refuse_unsupported()
        out: dict[str, Any] = {}
        act = {"calib_method": "ifmr", **_activation_type(self.offset, None)}
        common = root.get("common_config")
        level = self.level(common, "common", None, conv_bits=True) if common is not None else {}
        conv_bits = level.pop("conv_bits", None)
        top = {"input_tensors": dict(act), "output_tensors": dict(act),
               "weight": {"symmetric": True, "calib_method": "minmax"}}
        for tensor_class, spec in level.items():
            top[tensor_class] = None if spec is None else {**top.get(tensor_class, {}), **spec}
        out["global_quant_config"] = top
        out["layer_type_quant_config"] = types = self.overrides("override_layer_types", "layer_type", "type")
        if conv_bits is not None:
            conv = types.setdefault("Conv", {})
            conv["weight"] = {"bits": conv_bits, **(conv.get("weight") or {})}
        for name in root.all("skip_layer_types"):
            if name in types:
                raise self.refuse(self.line_of("skip_layer_types"), f"layer type {name!r} is both in "
                                  "skip_layer_types and override_layer_types; keep one")
            types[name] = {tc: dict(spec) for tc, spec in KEEP_FLOAT.items()}
        out["layer_quant_config"] = nodes = self.overrides("override_layer_configs", "layer_name", "layer")
        self.tensor_quantize(nodes)
        out["exclude"] = [re.escape(name) for name in root.all("skip_layers")]
        out["pre_quant_opt_config"] = self.fusion() + self.smoothquant()
        out["algo_config"] = self.adaround()
        if root.has("batch_num"):
            out["calibration"] = {"max_batches": root.get("batch_num")}
        return copy.deepcopy(out)  # no dict shared between tensor classes

    def line_of(self, name: str, msg: Message | None = None) -> int:
        msg = msg or self.root
        return next((line for key, _, line in msg.fields if key == name), msg.line)

    def _refuse_unsupported(self) -> None:
        root = self.root
        if root.get("joint_quant"):
            raise self.refuse(self.line_of("joint_quant"), "joint_quant (shared Eltwise scales) has no onnxq "
                              "counterpart; remove it or set it to false")
        if root.get("enable_auto_nuq") or root.has("nuq_config"):
            name = "enable_auto_nuq" if root.get("enable_auto_nuq") else "nuq_config"
            raise self.refuse(self.line_of(name), f"{name}: onnxq has no non-uniform quantization (NUQ); "
                              "remove it to quantize uniformly (ARQ)")
        mode = root.get("fakequant_precision_mode")
        if mode is not None and str(mode).upper() != "DEFAULT":
            if closest_name(str(mode), ["DEFAULT"]):  # a typo of the one mode onnxq has
                raise self.refuse(self.line_of("fakequant_precision_mode"), f"fakequant_precision_mode {mode}; "
                                  "did you mean DEFAULT? (onnxq computes fake quantization in float32)")
            raise self.refuse(self.line_of("fakequant_precision_mode"), f"fakequant_precision_mode {mode} has "
                              "no onnxq counterpart; remove it (onnxq computes fake quantization in float32)")

    def overrides(self, field: str, key: str, kind: str) -> dict[str, Any]:
        """op type or layer name -> its QuantizationConfig dict, from the override blocks."""
        out: dict[str, Any] = {}
        for block in self.root.all(field):
            name = block.get(key)
            if name is None:
                raise self.refuse(block.line, f"{field} needs {key}")
            if name in out:
                raise self.refuse(block.line, f"{key} {name!r} appears in two {field} blocks; merge them")
            config = block.get("calibration_config")
            level = self.level(config, kind, name) if config is not None else {}
            out[name] = {tc: (dict(KEEP_FLOAT[tc]) if spec is None else spec) for tc, spec in level.items()}
        return out

    def level(self, config: Message, kind: str, key: str | None, conv_bits: bool = False) -> dict[str, Any]:
        """One CalibrationConfig as tensor class -> spec dict (None: left float), plus
        `conv_bits` for common_config's 6/7-bit ARQ (Conv only, as in AMCT)."""
        names = config.names()
        if "nuq_quantize" in names:
            raise self.refuse(self.line_of("nuq_quantize", config), "nuq_quantize: onnxq has no non-uniform "
                              "quantization (NUQ); use arq_quantize or ada_quantize")
        out: dict[str, Any] = {}
        weight_algorithm = _last(names, WEIGHT_ALGORITHMS)
        if weight_algorithm is not None:
            block = config.get(weight_algorithm)
            weight: dict[str, Any] = {"calib_method": "minmax"}
            if block.has("channel_wise"):
                weight["qscheme"] = "per_channel" if block.get("channel_wise") else "per_tensor"
            if block.has("asymmetric"):
                weight["symmetric"] = not block.get("asymmetric")
            bits = block.get("quant_bits", block.get("num_bits"))
            if bits is not None and bits != 8:
                if conv_bits:
                    out["conv_bits"] = bits
                else:
                    weight["bits"] = bits
            out["weight"] = weight
            if weight_algorithm == "ada_quantize":
                self.ada.append((kind, key, block, block.line))
            else:
                self.arq.append((kind, key))
        activation = _last(names, ACTIVATION_ALGORITHMS)
        if activation is not None:
            out["input_tensors"] = out["output_tensors"] = self.activation(config.get(activation), activation)
        if config.get("weight_compress_only"):
            out["input_tensors"] = out["output_tensors"] = None
        if config.has("dmq_balancer"):
            block = config.get("dmq_balancer")
            self.dmq.append((kind, key, block.get("migration_strength", 0.5), block.line))
        return {tc: (dict(spec) if isinstance(spec, dict) else spec) for tc, spec in out.items()}

    def activation(self, block: Message, algorithm: str) -> dict[str, Any]:
        if algorithm == "ifmr_quantize":
            if block.get("num_bits", 8) != 8:
                raise self.refuse(block.line, "ifmr_quantize num_bits: use dst_type INT16 for 16-bit activations")
            spec = {"calib_method": "ifmr",
                    "calib_options": {k: block.get(k) for k in IFMR_OPTIONS if block.has(k)}}
        else:
            spec = {"calib_method": "hfmg", "calib_options": {"num_of_bins": block.get("num_of_bins")}
                    if block.has("num_of_bins") else {}}
        if block.has("asymmetric") or block.has("dst_type"):
            dst = block.get("dst_type")
            if dst is not None and str(dst).upper() not in ("INT8", "INT16"):
                raise self.refuse(block.line, f"dst_type {dst}: use INT8 or INT16")
            spec.update(_activation_type(block.get("asymmetric", self.offset), dst))
        return spec

    def tensor_quantize(self, nodes: dict[str, Any]) -> None:
        for block in self.root.all("tensor_quantize"):
            name = block.get("layer_name")
            if name is None or block.get("input_index", 0) != 0:
                raise self.refuse(block.line, "tensor_quantize: onnxq sets a node's input activations as a "
                                  "whole; give layer_name with input_index 0")
            algorithm = _last(block.names(), ACTIVATION_ALGORITHMS)
            spec = self.activation(block.get(algorithm), algorithm) if algorithm else {"calib_method": "ifmr"}
            nodes.setdefault(name, {})["input_tensors"] = spec

    def fusion(self) -> list[dict[str, Any]]:
        skip = self.root.all("skip_fusion_layers")
        if not self.root.get("do_fusion", True):
            return [{"name": "fold_batchnorm", "enabled": False}]
        return [{"name": "fold_batchnorm", "skip_fusion_layers": skip}] if skip else []

    def smoothquant(self) -> list[dict[str, Any]]:
        if not self.dmq:
            return []
        strengths = {strength for *_, strength, _ in self.dmq}
        if len(strengths) > 1:
            raise self.refuse(self.dmq[1][3], "dmq_balancer blocks with different migration_strength; onnxq's "
                              "smoothquant takes one strength for every layer it smooths")
        entry: dict[str, Any] = {"name": "smoothquant", "migration_strength": strengths.pop()}
        kinds = {kind for kind, *_ in self.dmq}
        if "layer" in kinds and "common" not in kinds:
            line = next(line for kind, *_, line in self.dmq if kind == "layer")
            raise self.refuse(line, "dmq_balancer in override_layer_configs: onnxq's smoothquant chooses "
                              "layers by op type; move it to common_config or override_layer_types")
        if "common" not in kinds:
            entry["op_types"] = sorted({key for kind, key, *_ in self.dmq if kind == "type"})
        return [entry]

    def adaround(self) -> list[dict[str, Any]]:
        if not self.ada:
            return []
        options = [{k: block.get(k) for k in ADA_OPTIONS if block.has(k)} for *_, block, _ in self.ada]
        if any(o != options[0] for o in options):
            line = next(line for (*_, line), o in zip(self.ada, options, strict=True) if o != options[0])
            raise self.refuse(line, "ada_quantize blocks with different options; onnxq's adaround takes one "
                              "set of options for every layer")
        entry: dict[str, Any] = {"name": "adaround", **options[0]}
        ada_types = {key for kind, key, *_ in self.ada if kind == "type"}
        arq_types = {key for kind, key in self.arq if kind == "type"}
        for kind, key, _, line in self.ada:
            if kind == "type" and key not in ADA_TYPES:
                raise self.refuse(line, f"ada_quantize for layer type {key!r}: adaround optimises "
                                  f"{', '.join(ADA_TYPES)} weights")
        common = any(kind == "common" for kind, *_ in self.ada)
        entry["op_types"] = [t for t in ADA_TYPES if t not in arq_types] if common else sorted(ada_types)
        named = sorted({key for kind, key, *_ in self.ada if kind == "layer"})
        skipped = sorted({key for kind, key in self.arq if kind == "layer"})
        if named:
            entry["layers"] = named
        if skipped:
            entry["skip_layers"] = skipped
        return [entry]


def _last(names: list[str], candidates: tuple[str, ...]) -> str | None:
    """The candidate configured last in a block (AMCT: the algorithm configured last wins)."""
    present = [n for n in names if n in candidates]
    return present[-1] if present else None


def _activation_type(asymmetric: bool, dst_type: str | None) -> dict[str, Any]:
    bits = "16" if dst_type is not None and str(dst_type).upper() == "INT16" else "8"
    return {"dtype": ("uint" if asymmetric else "int") + bits, "symmetric": not asymmetric}
