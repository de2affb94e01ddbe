"""Exercise 1.1's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase1/grade_1_1_sampler.py"

QUESTIONS = {
    "1.1": [
        GradedQuestion(
            asks="how many samples does each rank get when n divides by N, when it does not, and "
            "when it does not with drop_last",
            wrong="the count rounded up with drop_last too (the tail padded instead of cut)",
            caught_by=f"{GRADER}::test_sampler_yields_what_pytorch_yields",
        ),
        GradedQuestion(
            asks="which random stream draws the permutation",
            wrong="the global stream, re-seeded with seed + epoch by torch.manual_seed",
            caught_by=f"{GRADER}::test_the_shuffle_leaves_the_global_random_stream_alone",
        ),
        GradedQuestion(
            asks="a new one each epoch",
            wrong="a generator seeded with seed alone, the epoch left out",
            caught_by=f"{GRADER}::test_sampler_yields_what_pytorch_yields",
        ),
        GradedQuestion(
            asks="where do the padding repeats come from",
            wrong="the padding taken from the end of the list",
            caught_by=f"{GRADER}::test_sampler_yields_what_pytorch_yields",
        ),
        GradedQuestion(
            asks="what if more padding is needed than the dataset has samples",
            wrong="the list repeated at most once (too short when n < N)",
            caught_by=f"{GRADER}::test_sampler_yields_what_pytorch_yields",
        ),
        GradedQuestion(
            asks="which positions of the epoch's list belong to rank r of N",
            wrong="contiguous blocks: rank r takes positions r · num_samples onwards",
            caught_by=f"{GRADER}::test_sampler_yields_what_pytorch_yields",
        ),
    ],
}
