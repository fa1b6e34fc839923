"""Every setting as a frozen pydantic model: the recipe, its stage configs and their sections.

Plain pydantic, no torch, and nothing of the project above it: a module here imports only this package and
`grpo.texts` (tests/test_layers.py holds it to that), so a recipe is read and checked before anything heavy loads, and
every layer above can import it. Where a setting names something a layer above defines (a rule reward, a language,
a code language), the names are kept here and that layer checks on import that it offers exactly these.
"""
