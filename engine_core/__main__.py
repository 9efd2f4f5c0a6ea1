from engine_core.main import main

raise SystemExit(main())
