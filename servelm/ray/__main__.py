import sys

from servelm.ray.serve import main

sys.exit(main())
