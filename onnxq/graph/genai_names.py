"""File names of an onnxruntime-genai model folder, where more than one module reads them
(`graph/folder.py` reads the folder; `graph/save.py`, below it, names it in errors)."""

GENAI_CONFIG = "genai_config.json"
