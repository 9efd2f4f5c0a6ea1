from manager.daemon import main

raise SystemExit(main())
