"""The run of one config, stage by stage, below the front door (`onnxq/quantize.py`).

    prepare.py      load the model and run the passes before calibration; plan; pick the algorithms
    algorithms.py   which algorithms run, in which order, on the data the run can read
    calibration.py  calibrate (or read ranges / statistics files) and drop what cannot be quantized
    emission.py     emit, open as a deployment would, keep in float what onnxruntime refuses
    run.py          run_pipeline: the stages in order, the output check, the summary, the save
    result.py       QuantizationResult, and PipelineState for re-emitting under another config
    shards.py       calibration shards (`onnxq calibrate --shard`, `--shards N`)

Each stage takes read-only inputs and returns its result, notes included; `prepare` starts
the summary and `run_pipeline` completes it from the results the later stages return. This package's `__init__` imports nothing, so a module below the front door
(the accuracy-target search) can import one stage without loading the others.
"""
