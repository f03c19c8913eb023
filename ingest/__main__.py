import sys

from ingest.entry import main

sys.exit(main())
