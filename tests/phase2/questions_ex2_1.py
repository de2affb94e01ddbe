"""Exercise 2.1's guide questions and the test that fails a wrong answer to each.

Each wrong answer was planted in the reference solution (a scratch copy) and the named test
failed with a message about that decision."""

from question_grading import GradedQuestion

GRADER = "tests/phase2/grade_2_1_accumulation.py"

QUESTIONS = {
    "2.1": [
        GradedQuestion(
            asks="by what must that mean be multiplied so that the k backwards add up to the "
            "gradient of the mean over all B samples",
            wrong="each micro-batch's mean loss divided by k, the number of micro-batches",
            caught_by=f"{GRADER}::test_accumulated_gradient_equals_one_big_batch",
        ),
        GradedQuestion(
            asks="what weight does one sample of the short micro-batch get with your weights, and "
            "what would it get with 1/k",
            wrong="1/k for every micro-batch (the short one's samples over-weighted)",
            caught_by=f"{GRADER}::test_accumulated_gradient_equals_one_big_batch",
        ),
        GradedQuestion(
            asks="what does accumulate_gradients return when the last micro-batch is shorter",
            wrong="the plain mean of the micro-batches' mean losses",
            caught_by=f"{GRADER}::test_accumulated_gradient_equals_one_big_batch",
        ),
        GradedQuestion(
            asks="how many forwards does the model run per optimizer step, and on how many "
            "samples each",
            wrong="one forward and backward on the micro-batches concatenated back together",
            caught_by=f"{GRADER}::test_accumulated_gradient_equals_one_big_batch",
        ),
        GradedQuestion(
            asks="when are the gradients cleared, and how many times per optimizer step",
            wrong="never cleared: each step starts from the previous step's gradients",
            caught_by=f"{GRADER}::test_data_parallel_accumulation_all_reduces_once_per_step",
        ),
        GradedQuestion(
            asks="after which micro-batch do the ranks average their gradients, and how many "
            "all-reduces is that per optimizer step",
            wrong="average_gradients after every micro-batch",
            caught_by=f"{GRADER}::test_data_parallel_accumulation_all_reduces_once_per_step",
        ),
        GradedQuestion(
            asks="on which group does that average run",
            wrong="average_gradients called without group=, on the whole world",
            caught_by=f"{GRADER}::test_data_parallel_accumulation_stays_inside_its_group",
        ),
        GradedQuestion(
            asks="which micro-batches run inside no_sync(), and which part of each",
            wrong="every micro-batch's forward outside no_sync(), only the backward inside",
            caught_by=f"{GRADER}::test_ddp_no_sync_accumulation_equals_one_big_batch",
        ),
        GradedQuestion(
            asks="which backward then launches the bucket all-reduces, and on what sum",
            wrong="every micro-batch, the last included, inside no_sync()",
            caught_by=f"{GRADER}::test_ddp_no_sync_accumulation_equals_one_big_batch",
        ),
    ],
}
