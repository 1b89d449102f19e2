"""`python -m onnxq`, the same as the `onnxq` command."""

from onnxq.cli import main

raise SystemExit(main())
