"""The built-in engines, drafters, request parsers and cost models, registered through the same hooks third parties
use (``hookspecs.py``).  ``plugins.py`` loads these modules by name (``BUILTINS``), as it loads entry points, so
the registry imports none of what they register: each module sits just above the things it registers.
"""
