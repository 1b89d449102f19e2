"""`python -m onnxq.cli`, the same as `onnxq`."""

from onnxq.cli import main

raise SystemExit(main())
