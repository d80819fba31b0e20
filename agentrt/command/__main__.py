from agentrt.command import main

raise SystemExit(main())
