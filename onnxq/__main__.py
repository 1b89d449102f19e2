from onnxq.cli import main

raise SystemExit(main())
