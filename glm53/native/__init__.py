"""The project's native libraries as Python sees them: where they are found and how they are built (``libraries``,
standard library only: ``setup.py`` imports it). The bindings live with their users."""
