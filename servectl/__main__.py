"""``python -m servectl``: the ``servectl`` command, for hosts where only the interpreter is on PATH."""

from servectl.cli import main

if __name__ == "__main__":
    main(prog_name="servectl")
