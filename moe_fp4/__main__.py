from moe_fp4.cli import main

raise SystemExit(main())
