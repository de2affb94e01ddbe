"""Exercise 4.3's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase4/grade_4_3_elastic.py"
POLICY = f"{GRADER}::test_keep_global_recomputes_accumulation_and_scale_lr_scales_the_rate"
RESUMED = f"{GRADER}::test_a_position_the_new_world_does_not_divide_is_resumed_exactly"

QUESTIONS = {
    "4.3": [
        GradedQuestion(
            asks="under keep-global, what must change with the world so that a step still takes global_batch samples",
            wrong="the accumulation steps from global_batch over the micro-batch, the world left out",
            caught_by=POLICY,
        ),
        GradedQuestion(
            asks="When is there no whole number of accumulation steps, and why refuse rather than round",
            wrong="the accumulation steps rounded down, no refusal",
            caught_by=POLICY,
        ),
        GradedQuestion(
            asks="Under scale-lr, how many samples does one optimizer step take, and what is the learning rate",
            wrong="scale-lr keeps base_lr whatever the samples per step",
            caught_by=POLICY,
        ),
        GradedQuestion(
            asks="which count is the same on every rank of the new world, the position or something per rank",
            wrong="a per-rank count: each rank skips position / world_size of its own samples",
            caught_by=RESUMED,
        ),
        GradedQuestion(
            asks="Which comes first",
            wrong="deal first (every world_size-th sample from rank), then drop position / world_size",
            caught_by=RESUMED,
        ),
        GradedQuestion(
            asks="a world of 2 saved position 16, a world of 3 resumes; which samples does each rank train in its first step",
            wrong="rank 0 starts at o15 (16 // 3 = 5 of its own skipped)",
            caught_by=RESUMED,
        ),
    ],
}
