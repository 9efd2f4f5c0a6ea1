"""``python -m servectl.cli``: the ``servectl`` command (tests and scripts run it this way)."""

from servectl.cli import main

if __name__ == "__main__":
    main()
