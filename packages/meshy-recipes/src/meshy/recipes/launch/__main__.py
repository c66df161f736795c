"""What torchrun runs on every rank: `torchrun ... -m meshy.recipes.launch RECIPE` (what `meshy run` starts).

Before anything else (importing torch takes seconds, in which the agent could die unnoticed) the rank
asks to die with its torchrun agent; then it runs `meshy.recipes.launch.rank`.
"""

from meshy.recipes.launch.parent_death import die_with_parent

if __name__ == "__main__":
    die_with_parent()
    from meshy.recipes.launch.rank import main

    main()
