from engine_core.core import main

raise SystemExit(main())
