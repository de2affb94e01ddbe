"""Exercise 4.5's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase4/grade_4_5_monitoring.py"

QUESTIONS = {
    "4.5": [
        GradedQuestion(
            asks="what must mark move so that the next section begins where this one ended",
            wrong="self.last never moved: every section measured from start()",
            caught_by=f"{GRADER}::test_the_sections_tile_the_step",
        ),
        GradedQuestion(
            asks="On a GPU, what must happen before the clock is read",
            wrong="no torch.cuda.synchronize, or one after the clock is read",
            caught_by=f"{GRADER}::test_on_cuda_the_clock_is_read_after_the_kernels_finish",
        ),
        GradedQuestion(
            asks="what runs while the counter is active, and is its total multiplied by anything afterwards",
            wrong="the forward alone counted (or the counter's forward + backward total times 3)",
            caught_by=f"{GRADER}::test_training_flops_are_forward_plus_backward_counted_once",
        ),
        GradedQuestion(
            asks="How is a model of two inputs called",
            wrong="the scratch copy called on the first input only (the tuple not unpacked)",
            caught_by=f"{GRADER}::test_training_flops_are_forward_plus_backward_counted_once",
        ),
        GradedQuestion(
            asks="why the median of a rank's window and not its mean",
            wrong="the mean of the rank's window",
            caught_by=f"{GRADER}::test_the_straggler_rule_in_a_world_of_two",
        ),
        GradedQuestion(
            asks="what must every rank know to apply the rule, by which collective",
            wrong="each rank judges itself against an all-reduced mean of the medians",
            caught_by=f"{GRADER}::test_the_straggler_rule_in_a_world_of_two",
        ),
        GradedQuestion(
            asks="With medians of 10, 11, 17 and 100 ms and threshold 1.5, which ranks are named",
            wrong="the yardstick is the mean of the ranks' medians",
            caught_by=f"{GRADER}::test_the_straggler_rule_in_a_world_of_four_and_in_subgroups",
        ),
        GradedQuestion(
            asks="Is a rank exactly at the threshold named",
            wrong="named at or above threshold x the median (>=)",
            caught_by=f"{GRADER}::test_the_straggler_rule_in_a_world_of_two",
        ),
        GradedQuestion(
            asks="In the group (1, 3), which number stands for its second rank in the list",
            wrong="the rank inside the group (1) instead of the global rank (3)",
            caught_by=f"{GRADER}::test_the_straggler_rule_in_a_world_of_four_and_in_subgroups",
        ),
    ],
}
