"""One schema for every host: :class:`Recipe` (:mod:`.schema`), the presets as named recipes (:mod:`.named`), and
how each host reads one (:mod:`.hosts`: the old spellings' one table, what each host supplies).
"""

from offpolicy.recipe.schema import RECIPE_KEYS, Recipe, needs

__all__ = ["RECIPE_KEYS", "Recipe", "needs"]
