"""Exercise 3.5's guide questions and the test that fails a wrong answer to each.

Each wrong answer was planted in the reference solution (a scratch copy) and the named test
failed with a message about that decision.
"""

from question_grading import GradedQuestion

Z = "tests/phase3/grade_3_5_zero.py"
F = "tests/phase3/grade_3_5_zero_fsdp.py"

QUESTIONS = {
    "3.5": [
        GradedQuestion(
            asks="what must the sum be divided by to be the whole batch's gradient",
            wrong="the reduce-scattered sum returned as it is, not divided",
            caught_by=f"{Z}::test_ten_steps_equal_adamw_on_one_process[1-2]",
        ),
        GradedQuestion(
            asks="on which group does each of its collectives run, and whose size is N",
            wrong="the reduce-scatter run on the whole world (no group)",
            caught_by=f"{Z}::test_two_groups_of_two_train_independently[2]",
        ),
        GradedQuestion(
            asks="on which group does each of its collectives run, and whose size is N",
            wrong="the sum divided by the world's size inside a subgroup",
            caught_by=f"{Z}::test_two_groups_of_two_train_independently[2]",
        ),
        GradedQuestion(
            asks="How does `gather` tell a unit that holds its whole buffer already from a freed "
            "one",
            wrong="gather always all-gathers, also a unit that is whole already",
            caught_by=f"{Z}::test_frozen_and_tied_bytes_equal_the_formulas[2-tied]",
        ),
        GradedQuestion(
            asks="how do those saved tensors see the gathered values again, and what, then, may "
            "`free` release",
            wrong="free gives every parameter a new empty tensor as its data",
            caught_by=f"{Z}::test_ten_steps_equal_adamw_on_one_process[3-2]",
        ),
        GradedQuestion(
            asks="in which stages does a full gradient still exist when `step` runs",
            wrong="no reduce-scatter in step, in stage 1 either",
            caught_by=f"{Z}::test_ten_steps_equal_adamw_on_one_process[1-2]",
        ),
        GradedQuestion(
            asks="in which stages must every rank's model be brought up to date before `step` "
            "returns",
            wrong="no all-gather after the inner step, in stages 1-2 either",
            caught_by=f"{Z}::test_ten_steps_equal_adamw_on_one_process[2-2]",
        ),
        GradedQuestion(
            asks="What does the layer's backward need before it runs, and which module hook runs "
            "at that moment",
            wrong="no full backward pre-hook: the layer stays freed when its backward runs",
            caught_by=f"{Z}::test_ten_steps_equal_adamw_on_one_process[3-2]",
        ),
        GradedQuestion(
            asks="What frees the layer during forward, so that no more than one layer is ever "
            "gathered",
            wrong="no forward hook: every layer stays gathered from its forward to its backward",
            caught_by=f"{Z}::test_stage3_holds_the_shards_plus_one_layer_at_most[2]",
        ),
        GradedQuestion(
            asks="how do you recognise it as the one an earlier layer's unit holds already, and "
            "what must `owned` hold afterwards",
            wrong="the kept parameters' ids never added to owned",
            caught_by=f"{Z}::test_unit_parameters_give_each_trainable_parameter_one_unit_and_"
            "frozen_ones_none",
        ),
        GradedQuestion(
            asks="which of its parameters are its own",
            wrong="the layer's parameters listed with recursion, its children's included",
            caught_by=f"{Z}::test_unit_parameters_give_each_trainable_parameter_one_unit_and_"
            "frozen_ones_none",
        ),
        GradedQuestion(
            asks="Does the cast come before the collective or after it",
            wrong="the fp32 master shard all-gathered, cast afterwards",
            caught_by=f"{F}::test_fsdp_unit_casts_before_gathering_and_reduces_in_the_reduce_"
            "dtype[2]",
        ),
        GradedQuestion(
            asks="In which dtype must the sum be formed",
            wrong="the gradient reduce-scattered in the compute dtype (bf16) under a bf16-fp32 "
            "policy",
            caught_by=f"{F}::test_fsdp_unit_casts_before_gathering_and_reduces_in_the_reduce_"
            "dtype[2]",
        ),
        GradedQuestion(
            asks="in which dtype does the slice reach the optimizer",
            wrong="the reduced slice returned in the reduce dtype (bf16, fp16)",
            caught_by=f"{F}::test_fsdp_unit_casts_before_gathering_and_reduces_in_the_reduce_"
            "dtype[2]",
        ),
        GradedQuestion(
            asks="which unit must be waited for before `before` returns, and which gathers are "
            "only started",
            wrong="the next units' gathers waited for at once",
            caught_by=f"{F}::test_fsdp_gathers_ahead_within_the_prefetch_window[2]",
        ),
        GradedQuestion(
            asks="which unit must be waited for before `before` returns",
            wrong="the unit about to compute only started, never waited for",
            caught_by=f"{F}::test_fsdp_with_prefetch_windows_trains_like_one_process_in_float64[2]",
        ),
        GradedQuestion(
            asks="How many units ahead may hold memory while one computes",
            wrong="every later unit's gather started (an unbounded window)",
            caught_by=f"{F}::test_fsdp_gathers_ahead_within_the_prefetch_window[2]",
        ),
        GradedQuestion(
            asks="When unit i is recomputed, where has backward got to, and which hook would ever "
            "wait for a gather you start for unit i+1",
            wrong="the window's gathers started in a recompute too",
            caught_by=f"{F}::test_fsdp_with_activation_checkpointing_leaves_no_gather_behind[2]",
        ),
    ],
}
