"""``python -m spire ...`` runs the ``spire`` command line."""

from spire.cli import main

if __name__ == "__main__":
    main()
