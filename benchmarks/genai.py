"""onnxruntime-genai folders quantized by onnxq: size, quantize time and decode speed in
onnxruntime-genai, per recipe, on one machine in one run.

    python benchmarks/genai.py                       # a synthetic random Llama (shapes of a small LLM)
    python benchmarks/genai.py --folder genai_dir/   # a real folder (../shared/tools/llm/genai_smollm2.py)
        [--windows windows.npz] [--eval-ids stsb=eval.npz gpl3=extra.npz] [--baseline "builder b32=int4_dir/"]

Rows: float; W4_GROUP128 (RTN) with MatMulNBits accuracy_level 0 and 4; HQQ; W8_GROUP128;
with `--windows` (token windows, an .npz of input_ids) GPTQ and AWQ too. Decode speed: tokens
per second of greedy generation after a prompt, in onnxruntime-genai, median of `--repeat`.
With `--eval-ids` (.npz files of input_ids windows held out from the calibration text;
one should be a different text: the export tool's `--extra-text`), perplexity of each
model on each in a plain onnxruntime session (full-window prefill). Each recipe is
quantized in a child process, which gives its wall time and peak RSS; a folder with a
tokenizer also shows each model's greedy continuation of `--prompt`. Random
weights give speed and size, not accuracy: accuracy needs a real folder.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common as C
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the synthetic folder builder


def decode_tokens_per_s(folder: Path, prompt: list[int], new_tokens: int, repeat: int) -> float:
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    rates = []
    for _ in range(repeat):
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False, min_length=len(prompt) + new_tokens)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array(prompt, np.int32))
        start, made = time.perf_counter(), 0
        while not generator.is_done():
            generator.generate_next_token()
            made += 1
        rates.append(made / (time.perf_counter() - start))
    return statistics.median(rates)


def perplexity(model: Path, windows: np.ndarray) -> float:
    """exp(mean next-token cross-entropy) over the windows, one full prefill each."""
    import onnx
    import onnxruntime as ort

    from onnxq.calibrate.decoder import sliding_caches

    proto = onnx.load(str(model), load_external_data=False)
    past = {v.name: v for v in proto.graph.input if v.name.startswith("past_key_values.")}
    capacity = sliding_caches(proto)  # a sliding-window cache starts at the window's length
    config = json.loads((model.parent / "genai_config.json").read_text())["model"]["decoder"]
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    losses = []
    for window in windows:
        feeds = {"input_ids": window[None].astype(np.int64), "attention_mask": np.ones((1, len(window)), np.int64),
                 **{name: np.zeros((1, config["num_key_value_heads"], capacity.get(name, 0), config["head_size"]),
                                   np.float32) for name in past}}
        logits = session.run(["logits"], feeds)[0][0, :-1].astype(np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        losses.extend(-logp[np.arange(len(window) - 1), window[1:]])
    return float(np.exp(np.mean(losses)))


def folder_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.iterdir() if p.name.startswith("model.onnx")) / 1e6


def recipes(windows: Path | None) -> dict[str, tuple[str, dict, bool]]:
    """name -> (preset, config overrides, needs the windows)."""
    rows = {
        "w4 rtn acc0": ("W4_GROUP128", {"accuracy_level": 0}, False),
        "w4 rtn acc4": ("W4_GROUP128", {"accuracy_level": 4}, False),
        "w4 hqq acc4": ("W4_GROUP128", {"accuracy_level": 4, "algo_config": [{"name": "hqq"}]}, False),
        "w8 acc4": ("W8_GROUP128", {"accuracy_level": 4}, False),
    }
    if windows is not None:
        rows["w4 gptq acc4"] = ("W4_GROUP128", {"accuracy_level": 4, "algo_config": [{"name": "gptq"}]}, True)
        rows["w4 awq acc4"] = ("W4_GROUP128", {"accuracy_level": 4, "algo_config": [{"name": "awq"}]}, True)
    return rows


def quantize_in_child(source: Path, out: Path, preset: str, overrides: dict, data: Path | None) -> dict:
    """Quantize in a fresh process: wall seconds and that process's peak RSS (MB)."""
    job = json.dumps({"source": str(source), "out": str(out), "preset": preset, "overrides": overrides,
                      "data": None if data is None else str(data)})
    code = ("import json, sys, onnxq; j = json.loads(sys.argv[1]); "
            "onnxq.quantize(j['source'], j['out'], onnxq.compose_config(j['preset'], None, j['overrides']), "
            "j['data'], progress=False)")
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code, job])
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    if status:
        raise SystemExit(f"quantizing {out.name} failed (status {status})")
    return {"quantize s": seconds, "peak RSS MB": usage.ru_maxrss / 1024}


def greedy_text(folder: Path, prompt: str, new_tokens: int) -> str:
    """The folder's greedy continuation of `prompt` (needs its tokenizer)."""
    import onnxruntime_genai as og

    model = og.Model(str(folder))
    tokenizer = og.Tokenizer(model)
    params = og.GeneratorParams(model)
    ids = tokenizer.encode(prompt)
    params.set_search_options(max_length=len(ids) + new_tokens, do_sample=False)
    generator = og.Generator(model, params)
    generator.append_tokens(ids)
    while not generator.is_done():
        generator.generate_next_token()
    return tokenizer.decode(generator.get_sequence(0)[len(ids):]).replace("\n", " ")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, help="an onnxruntime-genai fp32 folder (default: a synthetic one)")
    parser.add_argument("--windows", type=Path, help="calibration token windows (.npz of input_ids) for GPTQ/AWQ")
    parser.add_argument("--eval-ids", nargs="*", default=[], metavar="NAME=FILE",
                        help="held-out token windows (.npz of input_ids), one perplexity column each")
    parser.add_argument("--baseline", nargs="*", default=[], metavar="NAME=FOLDER",
                        help="other quantized folders to measure beside (the model builder's int4)")
    parser.add_argument("--only", nargs="*", help="only these recipes (names as printed)")
    parser.add_argument("--prompt", default="The capital of France is",
                        help="greedy generation shown per row (folders with a tokenizer)")
    parser.add_argument("--layers", type=int, default=8, help="synthetic model: layers")
    parser.add_argument("--hidden", type=int, default=512, help="synthetic model: hidden size")
    parser.add_argument("--vocab", type=int, default=32000, help="synthetic model: vocabulary")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from genai_model import build_genai_folder

    work = Path(tempfile.mkdtemp(prefix="onnxq-genai-bench-"))
    try:
        if args.folder is None:
            source = build_genai_folder(work / "float", layers=args.layers, hidden=args.hidden, heads=8, kv_heads=4,
                                        vocab=args.vocab, context_length=512)
            what = f"synthetic Llama: {args.layers} layers, hidden {args.hidden}, vocabulary {args.vocab}"
        else:
            source, what = args.folder, str(args.folder)
        prompt = list(range(10, 42))
        evals = {name: np.load(path)["input_ids"] for name, _, path in (e.partition("=") for e in args.eval_ids)}
        rows = {"float": {"size MB": folder_mb(source), "quantize s": 0.0, "peak RSS MB": 0.0, "folder": source}}
        for name, (preset, overrides, needs) in recipes(args.windows).items():
            if args.only and name not in args.only:
                continue
            out = work / name.replace(" ", "_")
            rows[name] = {**quantize_in_child(source, out, preset, overrides, args.windows if needs else None),
                          "size MB": folder_mb(out), "folder": out}
        for spec in args.baseline:
            name, _, path = spec.partition("=")
            rows[name] = {"size MB": folder_mb(Path(path)), "quantize s": float("nan"), "peak RSS MB": float("nan"),
                          "folder": Path(path)}
        talks = (Path(source) / "tokenizer.json").is_file()
        for row in rows.values():
            row["decode tok/s"] = decode_tokens_per_s(row["folder"], prompt, args.new_tokens, args.repeat)
            for eval_name, windows in evals.items():
                row[f"ppl {eval_name}"] = perplexity(row["folder"] / "model.onnx", windows)
            if talks:
                row["text"] = greedy_text(row["folder"], args.prompt, 24)
        print(f"{what}; CPU flags: {C.cpu_flags()}; {os.cpu_count()} cores; onnxruntime-genai decode of "
              f"{args.new_tokens} tokens after a {len(prompt)}-token prompt, median of {args.repeat}; "
              "quantize time and peak RSS of a child process each")
        columns = ["size MB", "quantize s", "peak RSS MB", "decode tok/s"] + [f"ppl {e}" for e in evals]
        print(f"{'':16}" + "".join(f"{c:>14}" for c in columns) + f"{'speed vs float':>16}")
        base = rows["float"]["decode tok/s"]
        for name, row in rows.items():
            print(f"{name:16}" + "".join(f"{row[c]:14.2f}" for c in columns) + f"{row['decode tok/s'] / base:15.2f}x")
        if talks:
            print(f"\ngreedy continuations of {args.prompt!r}:")
            for name, row in rows.items():
                print(f"  {name:16} {row['text']!r}")
        if args.json:
            args.json.write_text(json.dumps({k: {c: v for c, v in r.items() if c != "folder"} for k, r in rows.items()},
                                            indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
