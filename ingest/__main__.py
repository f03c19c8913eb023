import sys

from ingest.cli import main

sys.exit(main())
