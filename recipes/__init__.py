"""The recipe packs that ship with the project, one per structured workload of the bundled tiny models
(``specgrammar recipes build`` writes them).  This folder ships in the wheel as the package
``specgrammar_plugins.recipes.shipped`` (package data); ``specgrammar_plugins.recipes.shipped_packs()`` lists them."""
