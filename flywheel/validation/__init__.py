"""The validation split and pass: the trainer's own yardstick, apart from the gate's holdout.

`split` sets aside a stratified share of the training tasks that the trainer never updates
on; `select` is the pure logic (the paired test, which version to propose, the overfitting
alarm); `store` reads and writes its tables; `scoring` scores each published version on the
validation tasks with the gate's cached-round machinery and acts on the outcome.
"""
