from moe_fp4.compare.cli import main

raise SystemExit(main())
