"""Exercise 1.4's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase1/grade_1_4_trainer.py"

QUESTIONS = {
    "1.4": [
        GradedQuestion(
            asks="which global batch sizes can every rank share equally",
            wrong="no check of the global batch: 63 accepted on 2 ranks",
            caught_by=f"{GRADER}::test_bad_arguments_fail_before_training",
        ),
        GradedQuestion(
            asks="what does a person need from the message to fix the command",
            wrong="a message that names neither the value given nor a size that works",
            caught_by=f"{GRADER}::test_bad_arguments_fail_before_training",
        ),
        GradedQuestion(
            asks="which object decides the order of the samples, and what must it be told before "
            "each epoch",
            wrong="start_epoch tells the sampler nothing",
            caught_by=f"{GRADER}::test_trainer_learns_reshuffles_and_every_all_reduce_gives_the_same_model",
        ),
        GradedQuestion(
            asks="a resumed one included",
            wrong="the sampler told the epoch, start_index not passed on",
            caught_by=f"{GRADER}::test_start_epoch_tells_the_sampler_the_epoch_and_where_to_resume",
        ),
        GradedQuestion(
            asks="which group and which all-reduce does the step use",
            wrong="the step run without group=, on the default group",
            caught_by=f"{GRADER}::test_two_groups_train_side_by_side_like_two_worlds_of_2",
        ),
        GradedQuestion(
            asks="which group and which all-reduce does the step use",
            wrong="the step run without the loop's all_reduce_fn (torch's all-reduce every time)",
            caught_by=f"{GRADER}::test_bytes_sent_follow_each_strategys_formula_on_4_ranks",
        ),
        GradedQuestion(
            asks="loss is a mean over what, and samples counts what",
            wrong="samples reported as 1 per step (the step count, not the batch's size)",
            caught_by=f"{GRADER}::test_bytes_sent_follow_each_strategys_formula_on_4_ranks",
        ),
        GradedQuestion(
            asks="how does the step learn the bytes this rank passed to send/isend",
            wrong="bytes_sent reported as the payload handed to the all-reduce",
            caught_by=f"{GRADER}::test_bytes_sent_follow_each_strategys_formula_on_4_ranks",
        ),
        GradedQuestion(
            asks="how many collectives for the whole dict",
            wrong="one all-reduce per key",
            caught_by=f"{GRADER}::test_reduce_totals_sums_every_key_in_one_collective",
        ),
        GradedQuestion(
            asks="and over which group",
            wrong="the totals all-reduced on the default group",
            caught_by=f"{GRADER}::test_two_groups_train_side_by_side_like_two_worlds_of_2",
        ),
        GradedQuestion(
            asks="how do the ranks agree on which value is which",
            wrong="the values packed in the order each rank's dict was filled",
            caught_by=f"{GRADER}::test_reduce_totals_sums_every_key_in_one_collective",
        ),
        GradedQuestion(
            asks="in which dtype do counts beyond 2^24 stay exact",
            wrong="the values in a float32 tensor",
            caught_by=f"{GRADER}::test_reduce_totals_sums_every_key_in_one_collective",
        ),
    ],
}
