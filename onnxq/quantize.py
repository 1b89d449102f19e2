"""The front door: `quantize()`, Quark's `ModelQuantizer`, and the calibration-shard entry
points. Below it, `onnxq/pipeline/` runs one config stage by stage (load, optimise,
calibrate, emit, save); `onnxq/search/` runs several to meet an accuracy target."""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from onnxq.analyze.quantized import report_quantization
from onnxq.calibrate.text import text_windows
from onnxq.config import Config, as_config
from onnxq.config.compose import DEFAULT_PRESET, ConfigLike, ConfigSources
from onnxq.config.defaults import config_for, default_note
from onnxq.config.spec import DEFAULT_LABELS, DEFAULT_LADDER, OptimizeFor
from onnxq.errors import ConfigError, ModelError, OnnxqError, renamed
from onnxq.graph.folder import (
    GENAI_CONFIG,
    copy_companions,
    data_files,
    open_folder,
    output_folder_before,
    output_model,
    remove_replaced_data,
)
from onnxq.graph.save import check_apart, check_output_paths
from onnxq.heap import settled_heap
from onnxq.notes import Note, Topic, counted, renamed_notes
from onnxq.optimize.registry import CONTRACTS, parse_algorithms, parse_passes
from onnxq.pipeline.prepare import WINDOWS_NOTE, ModelSource, required_opset
from onnxq.pipeline.result import PipelineState, QuantizationResult
from onnxq.pipeline.run import run_pipeline
from onnxq.pipeline.shards import ShardResult, calibrate_shard, calibrate_sharded
from onnxq.search.driver import quantize_to_target
from onnxq.search.latency import quantize_for_latency

__all__ = [
    "DEFAULT_PRESET",
    "ModelQuantizer",
    "ModelSource",
    "PipelineState",
    "QuantizationResult",
    "ShardResult",
    "calibrate_shard",
    "calibrate_sharded",
    "quantize",
    "required_opset",
    "run_pipeline",
]


def quantize(
    model: ModelSource,
    output: str | os.PathLike | None = None,
    config: ConfigLike = None,
    calibration_data: Any = None,
    *,
    progress: bool | None = None,
    evaluate: Any = None,
    report: str | os.PathLike | None = None,
) -> QuantizationResult:
    """Quantize `model` and, when `output` is given, save it there atomically.

    `model` may be a model folder (an onnxruntime-genai folder, or a folder with one
    .onnx model): `output` is then a folder that gets the quantized model under the same
    file name and a copy of every other file of the input folder (`graph/folder.py`).
    `calibration_data` is a path (.npz, .npy or a folder of them), a dict of arrays with
    samples on axis 0, an iterable of feed dicts, or a `CalibrationDataReader`; for an LLM
    decoder, `config.calibration.text` may name a text file instead (`calibrate/text.py`).
    With `config.mixed_precision.target` set, the most sensitive layers are raised in
    precision until the model meets it (`onnxq.search`); `evaluate(session) -> float`
    scores a model for a `custom` target. `report`: write an HTML report there (per-layer
    error measured on the evaluation data, else the calibration data).
    `config` takes every form `as_config` does; where it names no preset, the model's kind
    picks the default (`config/defaults.py`: weight-only int8 for an LLM decoder, else U8S8).
    """
    with settled_heap():  # the collector walks the run's objects, not the libraries' (`heap.py`)
        return _quantize(model, output, config, calibration_data, progress, evaluate, report)


def _quantize(model: ModelSource, output: str | os.PathLike | None, config: ConfigLike, calibration_data: Any,
              progress: bool | None, evaluate: Any, report: str | os.PathLike | None) -> QuantizationResult:
    """`quantize`'s body."""
    if not isinstance(model, str | os.PathLike | onnx.ModelProto | ir.Model):
        raise ModelError(f"model must be a path, an onnx.ModelProto or an onnx_ir.Model; got {type(model).__name__}"
                         + (" (for serialized bytes: onnx.load_from_string(data))" if isinstance(model, bytes) else ""))
    folder = open_folder(model) if isinstance(model, str | os.PathLike) else None
    given = config  # its file, if it names one, is read: never written over
    config, default_kind = config_for(folder or model, config)
    before: tuple[list[str], list[str]] = ([], [])
    if folder is not None:
        model = str(folder.model)
        named = output
        output = None if output is None else output_model(folder, output)
        before = ([], []) if output is None else output_folder_before(folder, Path(output).parent)
    check_output_paths(model if isinstance(model, str | os.PathLike) else None, report,
                       config.calibration.save_ranges)
    check_apart({"the output model": output, "the report": report,
                 "the ranges file (save_ranges)": config.calibration.save_ranges},
                read_paths(model, given, config, calibration_data))
    if report is not None and calibration_data is None and config.mixed_precision.eval_data is None \
            and config.calibration.text is None:  # refused before the model is written, not after
        raise ConfigError("the report measures the quantized model on data, and none was given; pass "
                          "mixed_precision.eval_data or calibration_data; for an LLM, token windows or calibration.text")
    replaced = data_files(output) if output is not None else ()  # an existing model's data, to clear after
    text = text_windows(model, config.calibration, calibration_data)
    if text is not None:  # the windows calibrate as an .npz of input_ids would
        calibration_data = {"input_ids": text.windows}
    keep = report is not None  # the report analyses the quantized model against the state it came from
    if evaluate is not None and config.mixed_precision.target is None:
        raise ConfigError("evaluate= scores models for an accuracy target; set "
                          "mixed_precision.target too, e.g. 'custom>=float-0.5'")
    if config.optimize_for == OptimizeFor.LATENCY:
        result = quantize_for_latency(model, output, config, calibration_data, progress, keep_state=keep)
    elif config.mixed_precision.target is not None:
        result = quantize_to_target(model, output, config, calibration_data, progress, evaluate, keep_state=keep)
    else:
        result = run_pipeline(model, output, config, calibration_data, progress, keep_state=keep)
    if text is not None:
        _insert_note(result.summary.notes, Note(Topic.CALIBRATION, text.describe()))
    result.summary.notes.extend(_unused_settings(config, report is not None))
    result.summary.notes.extend(_off_main_thread(result.summary.notes))
    copied: list[str] = []
    if folder is None and output is not None and isinstance(model, str | os.PathLike) \
            and (Path(model).parent / GENAI_CONFIG).is_file():
        result.summary.notes.append(Note(Topic.OUTPUT, f"{Path(model).name} is the model of an onnxruntime-genai "
                                         f"folder; only the model was written, without {GENAI_CONFIG} and the "
                                         f"tokenizer: pass the folder {Path(model).parent} to get a folder out"))
    if folder is not None and output is not None:
        copied = copy_companions(folder, Path(output).parent)
        shown = ", ".join(copied[:6]) + (", ..." if len(copied) > 6 else "")
        result.summary.notes.append(Note(Topic.OUTPUT, f"model folder: {len(copied)} other "
                                         f"file{'' if len(copied) == 1 else 's'} copied beside the model ({shown})" if copied else "model folder: no other file to copy",
                                         tuple(copied)))
        result.summary.notes.extend(_output_folder_notes(Path(named), Path(output), *before))
    if output is not None and (removed := remove_replaced_data(output, replaced, copied, model)):
        result.summary.notes.append(Note(Topic.OUTPUT, f"removed {', '.join(removed)}: external data of the "
                                         f"{Path(output).name} this run wrote over, which the new model does not use",
                                         tuple(removed)))
    result.config = result.config or config  # the latency plan's and the search's: the config they chose
    use = _data_use(result, calibration_data)
    if default_kind is not None and (note := default_note(default_kind, use)):
        result.summary.notes.insert(0, note)  # the recipe: before what the run says of it
    if use == "nothing":  # the windows were not read: a note describing them would say they were
        result.summary.notes = [n for n in result.summary.notes if n.source != WINDOWS_NOTE]
        if default_kind is None and report is None:  # the default's own note says so
            result.summary.notes.append(Note(Topic.CALIBRATION, UNREAD_DATA))
    if report is not None:
        held_out = config.mixed_precision.eval_data is not None
        data = config.mixed_precision.eval_data if held_out else calibration_data
        with result.summary.stage("report"):  # often most of the run: the time line says so
            report_quantization(report, result, result.config, data, progress, held_out)
    return result


def read_paths(model: ModelSource, given: ConfigLike, config: Config, data: Any) -> dict[str, object]:
    """The files a run reads, by what they are (`check_apart`: no output may be one)."""
    config_file = given.config_file if isinstance(given, ConfigSources) else given
    if not isinstance(config_file, str | os.PathLike) or not Path(config_file).is_file():
        config_file = None  # a preset's name, or no file
    return {"the input model": model, "the calibration data": data, "the config file": config_file,
            "the evaluation data": config.mixed_precision.eval_data, "the calibration text": config.calibration.text,
            "the ranges file to load (load_ranges)": config.calibration.load_ranges,
            **{f"the statistics file {path}": path for path in config.calibration.stats or ()}}


def _output_folder_notes(named: Path, output: Path, changed: list[str], others: list[str]) -> list[Note]:
    """What a folder run did to the output folder beyond writing the model (LLM trial): an
    output named like a model file became a folder; files there replaced or left."""
    said = []
    if named.suffix.lower() == ".onnx":
        said.append(f"the input is a model folder, so the output {named} is a folder too: its model is {output}")
    if changed:
        said.append(f"replaced {counted(len(changed), 'file')} the output folder held with the input folder's: "
                    f"{', '.join(changed[:6])}{', ...' if len(changed) > 6 else ''}")
    if others:
        said.append(f"the output folder also holds {counted(len(others), 'file')} the input folder does not, left as "
                    f"{'it was' if len(others) == 1 else 'they were'}: {', '.join(others[:6])}"
                    f"{', ...' if len(others) > 6 else ''}")
    return [Note(Topic.OUTPUT, text) for text in said]


def _unused_settings(config: Config, reporting: bool) -> list[Note]:
    """A note for each setting given that nothing of this run read (a flag for another feature)."""
    search, calibration = config.mixed_precision, config.calibration
    scored = search.target is not None or reporting
    unused = (
        (search.ladder != list(DEFAULT_LADDER) and search.target is None, Topic.SEARCH,
         "the ladder was not used: it is what the accuracy-target search tries (--accuracy-target)"),
        (search.rung_min_gain is not None and search.target is None, Topic.SEARCH,
         "the rung minimum gain was not used: it judges the accuracy-target search's algorithm rungs "
         "(--accuracy-target)"),
        (search.eval_data is not None and not scored, Topic.CALIBRATION,
         "the eval data was not read: it scores an accuracy target (--accuracy-target) and the HTML report "
         "(--report)"),
        (search.labels != DEFAULT_LABELS and not scored, Topic.CALIBRATION,
         f"the labels ({search.labels}) were not read: they score top-1 for an accuracy target "
         "(--accuracy-target) and the HTML report (--report)"),
        (calibration.sequence_length is not None and calibration.text is None, Topic.CALIBRATION,
         "the sequence length was not used: it cuts calibration text (--calib-text) into windows"),
    )
    return [Note(topic, text) for given, topic, text in unused if given]


def _off_main_thread(found: list[Note]) -> list[Note]:
    """A note where such an algorithm ran outside the main thread: from another thread
    numpy's OpenBLAS 0.3.31 ignores the limit, and GPTQ's codes differed from a main-thread
    run's (65 of 343 MiniLM tensors, in their last bits: determinism trial)."""
    ran = sorted({n.source for n in found if n.topic is Topic.ALGORITHM and n.source in CONTRACTS
                  and CONTRACTS[n.source].serial_blas})
    if not ran or threading.current_thread() is threading.main_thread():
        return []
    return [Note(Topic.ALGORITHM, f"{', '.join(ran)} ran outside the main thread, where the BLAS library takes no "
                 "thread limit: its rounding can differ in the last bits from a run on the main thread; call "
                 "quantize() from the main thread or a process pool where outputs must be byte-identical")]


def _insert_note(found: list[Note], note: Note) -> None:
    """`note` before the first note of its topic (the calibration text before its windows)."""
    at = next((i for i, n in enumerate(found) if n.topic is note.topic), len(found))
    found.insert(at, note)


# Data given to a run that nothing read (LLM trial: W4 round-to-nearest with --calib-text
# said how the text was cut, and the output came out byte-identical to a run without it).
UNREAD_DATA = ("the calibration data was not read: nothing in this recipe calibrates or fits to data (weights rounded "
               "alone), and the output check did not run; an algorithm that reads data (GPTQ, AWQ) uses it, and "
               "calibration.check_samples 8 checks the output on it")


def _data_use(result: QuantizationResult, calibration_data: Any) -> str | None:
    """What read the calibration data of a run: `calibration` (its pass, a pass or an
    algorithm that reads data, or an accuracy target's search), `check` (the output check
    or the latency's timing alone) or `nothing`; None where none was given."""
    if calibration_data is None:
        return None
    summary, config = result.summary, result.config
    entries = (*parse_passes(config.pre_quant_opt_config), *parse_algorithms(config.algo_config))
    if summary.calibration_samples or summary.calibrated_tensors or summary.mixed_precision is not None or any(
            e.enabled and e.contract.data != "none" for e in entries):
        return "calibration"
    return "check" if summary.fidelity is not None or summary.latency is not None else "nothing"


# What errors and notes call the data, in the words of a wrapper that takes a reader.
READER_NAMES = {"pass calibration_data": "pass calibration_data_reader"}


class ModelQuantizer:
    """Quark-style entry point: `ModelQuantizer(config).quantize_model(in, out, reader)`."""

    def __init__(self, config: Config | Mapping[str, Any] | str | None = None) -> None:
        self.config = as_config(config)

    def quantize_model(
        self, model_input: ModelSource, model_output: str | os.PathLike | None = None,
        calibration_data_reader: Any = None,
    ) -> QuantizationResult:
        try:
            result = quantize(model_input, model_output, self.config, calibration_data_reader)
        except OnnxqError as exc:  # its errors and notes name this method's parameter
            raise renamed(exc, READER_NAMES) from None
        result.summary.notes[:] = renamed_notes(result.summary.notes, READER_NAMES)
        return result
