"""What torchrun runs on every rank: `torchrun ... -m meshy.recipes.rank RECIPE` (what `meshy run` starts).

Before anything else (importing torch takes seconds, in which the agent could die unnoticed) the rank
asks to die with its torchrun agent; then it runs `meshy.recipes.launch`.
"""

from meshy.recipes.parent_death import die_with_parent

if __name__ == "__main__":
    die_with_parent()
    from meshy.recipes.launch import main

    main()
