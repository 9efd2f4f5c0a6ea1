from manager.main import main

raise SystemExit(main())
