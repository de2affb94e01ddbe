"""Exercise 3.4's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase3/grade_3_4_ddp.py"

QUESTIONS = {
    "3.4": [
        GradedQuestion(
            asks="in which order does a chain's backward make its gradients ready",
            wrong="the parameters walked in registration order, index 0 first",
            caught_by=f"{GRADER}::test_assign_buckets_matches_torchs_bucket_assignment",
        ),
        GradedQuestion(
            asks="With parameters of two dtypes interleaved, how many buckets are open at once",
            wrong="one open bucket for every kind together",
            caught_by=f"{GRADER}::test_assign_buckets_matches_torchs_bucket_assignment",
        ),
        GradedQuestion(
            asks="Where must the division by the group's size happen",
            wrong="the raw gradients summed, the sum divided by the world after the wait",
            caught_by=f"{GRADER}::test_fp16_average_does_not_overflow",
        ),
        GradedQuestion(
            asks="When must a bucket's all-reduce start for any of it to overlap backward",
            wrong="every bucket launched only once the last gradient of the backward is in",
            caught_by=f"{GRADER}::test_buckets_are_all_reduced_once_each_as_soon_as_ready",
        ),
        GradedQuestion(
            asks="which all-reduce of the other ranks would it pair with",
            wrong="each bucket launched as soon as it is full, whatever the earlier ones",
            caught_by=f"{GRADER}::test_buckets_are_all_reduced_once_each_as_soon_as_ready",
        ),
        GradedQuestion(
            asks="When, then, is bucket 2 launched, and by which call",
            wrong="each bucket launched as soon as it is full, whatever the earlier ones",
            caught_by=f"{GRADER}::test_buckets_are_all_reduced_once_each_as_soon_as_ready",
        ),
        GradedQuestion(
            asks="May _mark_ready wait for the all-reduce it started",
            wrong="the hook waits for each bucket's work right after launching it",
            caught_by=f"{GRADER}::test_buckets_are_all_reduced_once_each_as_soon_as_ready",
        ),
        GradedQuestion(
            asks="when may a bucket's buffer be read",
            wrong="the slots copied into .grad without waiting for the bucket's work",
            caught_by=f"{GRADER}::test_gradients_are_read_only_after_waiting",
        ),
        GradedQuestion(
            asks="what must that .grad hold when backward returns",
            wrong="a .grad of None left None (only existing .grad tensors receive the average)",
            caught_by=f"{GRADER}::test_training_equals_torch_ddp_and_one_process[features-2]",
        ),
        GradedQuestion(
            asks="What did _mark_ready change during this backward that the next backward must "
            "find as it was",
            wrong="self._next_bucket not set back to 0 after the backward",
            caught_by=f"{GRADER}::test_buckets_are_all_reduced_once_each_as_soon_as_ready",
        ),
        GradedQuestion(
            asks="what must the flag be after a block that raised",
            wrong="the flag restored after the yield, without a finally clause",
            caught_by=f"{GRADER}::test_no_sync_accumulates_and_all_reduces_once_per_step",
        ),
        GradedQuestion(
            asks="And after a no_sync() nested inside another, while the outer one is still open",
            wrong="the flag set back to True when a block ends",
            caught_by=f"{GRADER}::test_no_sync_accumulates_and_all_reduces_once_per_step",
        ),
    ],
}
