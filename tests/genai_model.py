"""A tiny random-weight Llama in the onnxruntime-genai folder format, for tests.

Writes what `onnxruntime_genai.models.builder` (0.18) writes for a Llama exported for CPU in
fp32: `model.onnx` with every weight in `model.onnx.data`, and `genai_config.json`. Node,
weight and I/O names, op types, domains and attributes follow the builder, so the folder looks
like the ones users quantize:

- the attention mask feeds GroupQueryAttention through seqlens_k = ReduceSum(mask) - 1 and
  total_sequence_length = Shape(mask)[1], both cast to int32;
- the first norm is SimplifiedLayerNormalization (default domain; onnx's checker does not know
  it, onnxruntime does), every later one SkipSimplifiedLayerNormalization (com.microsoft);
- Q, K and V are one packed MatMul (`qkv_proj`, the builder's CPU default; `packed_qkv=False`
  gives separate q/k/v MatMuls, as `disable_qkv_fusion` does), GQA applies the rotary
  embedding itself (`do_rotary=1`, cos/sin caches), so there is no `position_ids` input;
- SwiGLU MLP: gate/up/down MatMuls, Sigmoid * gate, * up;
- tied embeddings as the builder ties them: the LM head's `lm_head.MatMul.weight` [hidden,
  vocab] is the one table, and the embedding Gathers from its Transpose.

No tokenizer is written: onnxruntime-genai loads the model and generates from token ids
without one. Weights are seeded normal draws, so a folder is a pure function of its arguments.
`build_genai_folder` streams each weight to model.onnx.data as it is drawn (the bytes
`onnx.save_model` writes, without holding the model's weights): at TinyLlama's shape
(`benchmarks/llama_1b.py`, 4.4 GB) it needs a few hundred MB.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

MS = "com.microsoft"
BOS_TOKEN_ID, EOS_TOKEN_ID = 1, 2  # Llama's; the builder pads with the EOS id when none is set
EMBED_STD = 0.1   # token table (and tied LM head): logits come out with a std near 1
GAIN = 1.5        # projections draw std GAIN / sqrt(fan_in): layers move the next-token choice
DRAW_CHUNK = 1 << 22  # values drawn at a time (float64): the draws are the same, 32 MB at a time


@dataclass
class DataSink:
    """An external data file the weights are appended to as they are made, as onnx's
    `save_model(..., save_as_external_data=True, all_tensors_to_one_file=True)` appends
    them (no alignment gap; keys location, offset, length)."""

    file: BinaryIO
    location: str

    def external(self, name: str, array: np.ndarray) -> TensorProto:
        """Write `array` at the end of the file; its initializer, naming that place."""
        offset = self.file.tell()
        self.file.write(array.data)  # C-contiguous (`_Parts.weight`): no copy
        tensor = TensorProto(name=name, dims=array.shape, data_location=TensorProto.EXTERNAL,
                             data_type=helper.np_dtype_to_tensor_dtype(array.dtype))
        for key, value in (("location", self.location), ("offset", offset), ("length", array.nbytes)):
            tensor.external_data.add(key=key, value=str(value))
        return tensor


@dataclass
class _Parts:
    """The graph being written: nodes in topological order, weights (inline, or written to
    `sink` as they come), typed intermediates."""

    nodes: list = field(default_factory=list)
    initializers: list = field(default_factory=list)
    value_info: list = field(default_factory=list)
    constants: set = field(default_factory=set)
    sink: DataSink | None = None

    def node(self, op, inputs, outputs, name, domain="", **attrs):
        own = []  # this node's outputs, typed by the caller just before: they follow its constants
        while self.value_info and self.value_info[-1].name in outputs:
            own.insert(0, self.value_info.pop())
        for value in inputs:  # the builder's "/model/constants/..." names become Constant nodes
            if value.startswith("/model/constants/") and value not in self.constants:
                self.constants.add(value)
                self.nodes.append(_constant(value))
                # typed as a scalar even when it holds [1]: the builder's quirk, kept
                self.typed(value, TensorProto.INT64 if "INT64" in value else TensorProto.INT32, [])
        self.value_info += own
        self.nodes.append(helper.make_node(op, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0]

    def weight(self, name, array):
        array = np.ascontiguousarray(array)
        self.initializers.append(numpy_helper.from_array(array, name) if self.sink is None
                                 else self.sink.external(name, array))
        return name

    def weight_info(self):
        """value_info for every weight, as the builder (through onnx-ir) writes it."""
        return [helper.make_tensor_value_info(t.name, t.data_type, t.dims) for t in self.initializers]

    def typed(self, name, elem_type, shape):
        self.value_info.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name


def _constant(name: str) -> onnx.NodeProto:
    """A builder constant: '/model/constants/INT64/[1]' holds int64 [1], '.../INT64/1' a scalar."""
    dtype, literal = name.split("/")[-2:]
    value = np.array(json.loads(literal), dtype={"INT64": np.int64, "INT32": np.int32}[dtype])
    return helper.make_node("Constant", [], [name], name=name.replace("constants", "constant_nodes"),
                            value=numpy_helper.from_array(value))


def _hidden(last_dim):
    return ["batch_size", "sequence_length", last_dim]


def _matmul(parts, basename, x, weight, out=None):
    """The builder's float MatMul: weight '<name without slash, dots>.weight', [in, out]."""
    name = f"{basename}/MatMul"
    weight_name = parts.weight(name[1:].replace("/", ".") + ".weight", weight)
    output = out or parts.typed(f"{name}/output_0", TensorProto.FLOAT, _hidden(weight.shape[1]))
    return parts.node("MatMul", [x, weight_name], [output], name)


def _norm(parts, layer, location, root, skip, weight, hidden, eps, last=False):
    """(Skip)SimplifiedLayerNormalization; returns (normed, residual sum or None)."""
    base = f"/model/layers.{layer}/{location}_layernorm"
    w = parts.weight(f"model.layers.{layer}.{location}_layernorm.weight", weight)
    out0 = parts.typed(f"{base}/output_0", TensorProto.FLOAT, _hidden(hidden))
    if skip is None:
        parts.node("SimplifiedLayerNormalization", [root, w], [out0], f"{base}/LayerNorm",
                   epsilon=eps, axis=-1, stash_type=1)
        return out0, None
    if last:
        parts.node("SkipSimplifiedLayerNormalization", [root, skip, w], [out0],
                   f"{base}/SkipLayerNorm", domain=MS, epsilon=eps)
        return out0, None
    out3 = parts.typed(f"{base}/output_3", TensorProto.FLOAT, _hidden(hidden))
    parts.node("SkipSimplifiedLayerNormalization", [root, skip, w], [out0, "", "", out3],
               f"{base}/SkipLayerNorm", domain=MS, epsilon=eps)
    return out0, out3


def _mask_subgraph(parts):
    """seqlens_k and total_sequence_length for GQA, named as the builder names them."""
    base = "/model/attn_mask_reformat/attn_mask_subgraph"
    one, axis1 = "/model/constants/INT64/1", "/model/constants/INT64/[1]"
    total = parts.node("ReduceSum", ["attention_mask", axis1],
                       [parts.typed(f"{base}/ReduceSum/output_0", TensorProto.INT64, ["batch_size"])],
                       f"{base}/ReduceSum", keepdims=0)
    less1 = parts.node("Sub", [total, axis1],
                       [parts.typed(f"{base}/Sub/output_0", TensorProto.INT64, ["batch_size"])],
                       f"{base}/Sub")
    seqlens_k = parts.node("Cast", [less1],
                           [parts.typed(f"{base}/Sub/Cast/output_0", TensorProto.INT32, ["batch_size"])],
                           f"{base}/Sub/Cast", to=TensorProto.INT32)
    shape = parts.node("Shape", ["attention_mask"],
                       [parts.typed(f"{base}/Shape/output_0", TensorProto.INT64, [2])], f"{base}/Shape")
    width = parts.node("Gather", [shape, one],
                       [parts.typed(f"{base}/Gather/output_0", TensorProto.INT64, [])],
                       f"{base}/Gather", axis=0)
    total_len = parts.node("Cast", [width],
                           [parts.typed(f"{base}/Gather/Cast/output_0", TensorProto.INT32, None)],
                           f"{base}/Gather/Cast", to=TensorProto.INT32)
    return seqlens_k, total_len


def _rotary_caches(head_size, context_length, theta=10000.0):
    """cos/sin caches [context_length, head_size / 2], as the builder computes them."""
    inv_freq = np.float32(1.0) / (np.float32(theta) ** (
        np.arange(0, head_size, 2, dtype=np.int64).astype(np.float32) / np.float32(head_size)))
    freqs = np.outer(np.arange(context_length, dtype=np.float32), inv_freq).astype(np.float32)
    return {"cos_cache": np.cos(freqs), "sin_cache": np.sin(freqs)}


def _attention(parts, i, x, draw, dims, mask, caches, packed_qkv):
    """Q/K/V projection, GroupQueryAttention with rotary inside, output projection."""
    hidden, heads, kv_heads, head_size = dims
    base = f"/model/layers.{i}/attn"
    q_w, k_w, v_w = (draw(hidden, heads * head_size), draw(hidden, kv_heads * head_size),
                     draw(hidden, kv_heads * head_size))
    if packed_qkv:
        q = _matmul(parts, f"{base}/qkv_proj", x, np.concatenate([q_w, k_w, v_w], axis=1))
        k = v = ""
    else:
        q, k, v = (_matmul(parts, f"{base}/{p}_proj", x, w)
                   for p, w in (("q", q_w), ("k", k_w), ("v", v_w)))
    if i == 0:  # the first GQA registers the caches every layer shares
        for cache_name, cache in caches.items():
            parts.weight(cache_name, cache)
    name = f"{base}/GroupQueryAttention"
    out = parts.typed(f"{name}/output_0", TensorProto.FLOAT, _hidden(heads * head_size))
    parts.node("GroupQueryAttention",
               [q, k, v, f"past_key_values.{i}.key", f"past_key_values.{i}.value", *mask, *caches,
                "", "", ""],  # position_ids, attention_bias, sinks: unused, kept as the builder does
               [out, f"present.{i}.key", f"present.{i}.value"], name, domain=MS,
               num_heads=heads, kv_num_heads=kv_heads, scale=float(1 / np.sqrt(head_size)),
               local_window_size=-1, softcap=0.0, do_rotary=1, rotary_interleaved=0)
    return _matmul(parts, f"{base}/o_proj", out, draw(heads * head_size, hidden))


def _mlp(parts, i, x, draw, hidden, intermediate):
    """SwiGLU: down(silu(gate(x)) * up(x)), silu as Sigmoid then Mul."""
    base = f"/model/layers.{i}/mlp"
    gate = _matmul(parts, f"{base}/gate_proj", x, draw(hidden, intermediate))
    up = _matmul(parts, f"{base}/up_proj", x, draw(hidden, intermediate))
    sig = parts.node("Sigmoid", [gate],
                     [parts.typed(f"{base}/act_fn/Sigmoid/output_0", TensorProto.FLOAT,
                                  _hidden(intermediate))], f"{base}/act_fn/Sigmoid")
    silu = parts.node("Mul", [gate, sig],
                      [parts.typed(f"{base}/act_fn/Mul/output_0", TensorProto.FLOAT,
                                   _hidden(intermediate))], f"{base}/act_fn/Mul")
    prod = parts.node("Mul", [silu, up],
                      [parts.typed(f"{base}/Mul/output_0", TensorProto.FLOAT, _hidden(intermediate))],
                      f"{base}/Mul")
    return _matmul(parts, f"{base}/down_proj", prod, draw(intermediate, hidden))


def build_genai_model(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seed=0,
                      tie_embeddings=True, *, intermediate=None, context_length=128,
                      packed_qkv=True, eps=1e-5, sink: DataSink | None = None) -> onnx.ModelProto:
    """The decoder graph, its weights inline or, with `sink`, written to that file as they
    are drawn; `build_genai_folder` saves it with its config."""
    if hidden % heads or heads % kv_heads or (hidden // heads) % 2:
        raise ValueError("need hidden % heads == 0, heads % kv_heads == 0 and an even head size")
    head_size, intermediate = hidden // heads, intermediate or 2 * hidden
    rng = np.random.default_rng(seed)

    def draw(fan_in, *rest, std=None):
        """float32 normal draws, made in float64 rows of at most DRAW_CHUNK values (the
        generator gives the same values as one draw of the whole shape)."""
        std = GAIN / np.sqrt(fan_in) if std is None else std
        out = np.empty((fan_in, *rest), np.float32)
        rows = max(1, DRAW_CHUNK // max(1, int(np.prod(rest, dtype=np.int64))))
        for start in range(0, fan_in, rows):
            out[start:start + rows] = rng.standard_normal((min(rows, fan_in - start), *rest)) * std
        return out

    def norm_weight():
        return (1.0 + draw(hidden, std=0.1)).astype(np.float32)

    parts = _Parts(sink=sink)
    mask = _mask_subgraph(parts)
    table = draw(vocab, hidden, std=EMBED_STD)  # [vocab, hidden]
    lm_head = "lm_head.MatMul.weight"  # registered last, where the builder registers it
    if tie_embeddings:
        table_in = parts.node("Transpose", [lm_head],
                              [parts.typed("/model/embed_tokens/Transpose/output_0", TensorProto.FLOAT,
                                           [vocab, hidden])], "/model/embed_tokens/Transpose", perm=[1, 0])
    else:
        table_in = parts.weight("model.embed_tokens.weight", table)
        del table  # untied: written; not held through the layers
    embedded = parts.node("Gather", [table_in, "input_ids"],
                          [parts.typed("/model/embed_tokens/Gather/output_0", TensorProto.FLOAT,
                                       _hidden(hidden))], "/model/embed_tokens/Gather")
    caches = _rotary_caches(head_size, context_length)
    dims = (hidden, heads, kv_heads, head_size)

    root, skip = embedded, None
    for i in range(layers):
        x, summed = _norm(parts, i, "input", root, skip, norm_weight(), hidden, eps)
        root = summed or root
        skip = _attention(parts, i, x, draw, dims, mask, caches, packed_qkv)
        x, root = _norm(parts, i, "post_attention", root, skip, norm_weight(), hidden, eps)
        skip = _mlp(parts, i, x, draw, hidden, intermediate)
    x, _ = _norm(parts, layers, "final_norm", root, skip, norm_weight(), hidden, eps, last=True)
    if tie_embeddings:
        parts.weight(lm_head, table.T)
        parts.node("MatMul", [x, lm_head], ["logits"], "/lm_head/MatMul")
    else:
        _matmul(parts, "/lm_head", x, draw(hidden, vocab, std=EMBED_STD), out="logits")

    f32, kv = TensorProto.FLOAT, ["batch_size", kv_heads]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", f32, _hidden(vocab))]
    for kind in ("key", "value"):  # the builder lists every layer's keys, then every layer's values
        inputs += [helper.make_tensor_value_info(f"past_key_values.{i}.{kind}", f32,
                                                 [*kv, "past_sequence_length", "kv_cache_dim"])
                   for i in range(layers)]
        outputs += [helper.make_tensor_value_info(f"present.{i}.{kind}", f32,
                                                  [*kv, "total_sequence_length", "kv_cache_dim"])
                    for i in range(layers)]
    graph = helper.make_graph(parts.nodes, "main_graph", inputs, outputs, parts.initializers,
                              value_info=parts.weight_info() + parts.value_info)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 22),
                                                    helper.make_opsetid(MS, 1)],
                              producer_name="onnxruntime-genai", producer_version="0.18.0+00d66ef")
    model.ir_version = 10
    return model


def genai_config(layers, hidden, heads, kv_heads, vocab, context_length=128) -> dict:
    """genai_config.json as the 0.18 builder writes it for a Llama on CPU (keys in its order)."""
    return {
        "model": {
            "bos_token_id": BOS_TOKEN_ID,
            "context_length": context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": hidden // heads,
                "hidden_size": hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": heads,
                "num_hidden_layers": layers,
                "num_key_value_heads": kv_heads,
            },
            "eos_token_id": EOS_TOKEN_ID,
            "pad_token_id": EOS_TOKEN_ID,
            "type": "llama",
            "vocab_size": vocab,
        },
        "search": {
            "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
            "length_penalty": 1.0, "max_length": context_length, "min_length": 0,
            "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
            "past_present_share_buffer": True, "repetition_penalty": 1.0, "temperature": 1.0,
            "top_k": 50, "top_p": 1.0,
        },
    }


def build_genai_folder(folder, layers=2, hidden=64, heads=4, kv_heads=2, vocab=256, seed=0,
                       tie_embeddings=True, **options) -> Path:
    """Write model.onnx (+ model.onnx.data) and genai_config.json into `folder`; return it.

    `options` go to `build_genai_model` (intermediate, context_length, packed_qkv, eps).
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "model.onnx.data", "wb") as data:
        model = build_genai_model(layers, hidden, heads, kv_heads, vocab, seed, tie_embeddings,
                                  sink=DataSink(data, "model.onnx.data"), **options)
    (folder / "model.onnx").write_bytes(model.SerializeToString())
    config = genai_config(layers, hidden, heads, kv_heads, vocab,
                          options.get("context_length", 128))
    (folder / "genai_config.json").write_text(json.dumps(config, indent=4))
    return folder


def genai_generate(folder, prompt, new_tokens) -> list[int]:
    """Greedy tokens onnxruntime-genai generates from the folder after `prompt`; the test
    skips where onnxruntime-genai is not importable (the test extra installs it; a wheel
    whose native library fails to load skips too)."""
    import pytest

    try:
        import onnxruntime_genai as og
    except ImportError as error:
        pytest.skip(f"onnxruntime-genai is not importable: {error}")
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    # min_length: a random model may draw the EOS id; the tests count the tokens made
    params.set_search_options(max_length=len(prompt) + new_tokens, min_length=len(prompt) + new_tokens,
                              do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(np.array(prompt, np.int32))
    while not generator.is_done():
        generator.generate_next_token()
    return [int(t) for t in generator.get_sequence(0)[len(prompt):]]
