from api_gateway.app import main

raise SystemExit(main())
