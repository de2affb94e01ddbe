"""Exercise 4.4's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase4/grade_4_4_compression.py"

QUESTIONS = {
    "4.4": [
        GradedQuestion(
            asks="what does their sum become in fp16, and so must the division by the world come",
            wrong="cast, all-reduce, then divide the sum by the world (inf where 3 x 40000)",
            caught_by=f"{GRADER}::test_fp16_and_bf16_hooks_equal_torchs_bit_for_bit",
        ),
        GradedQuestion(
            asks="in which order does it cast and divide",
            wrong="divide in the bucket's dtype, then cast to 16 bits",
            caught_by=f"{GRADER}::test_fp16_and_bf16_hooks_equal_torchs_bit_for_bit",
        ),
        GradedQuestion(
            asks="the k entries are chosen from what: this step's gradient, or something else",
            wrong="the top-k of the gradient alone, the old error left out of the choice",
            caught_by=f"{GRADER}::test_topk_sends_k_pairs_and_keeps_the_rest_as_error",
        ),
        GradedQuestion(
            asks="By which measure are the k entries the largest, and which sign do the values sent keep",
            wrong="the k largest values (not magnitudes), or the magnitudes sent without their sign",
            caught_by=f"{GRADER}::test_topk_sends_k_pairs_and_keeps_the_rest_as_error",
        ),
        GradedQuestion(
            asks="why can an all-reduce not add their sparse vectors for fewer bytes than the dense gradient",
            wrong="the sparse vector scattered into a dense buffer and all-reduced",
            caught_by=f"{GRADER}::test_topk_sends_k_pairs_and_keeps_the_rest_as_error",
        ),
        GradedQuestion(
            asks="in what order, so that every rank ends with the same bits",
            wrong="each rank adds its own pairs first, then the next ranks' in turn",
            caught_by=f"{GRADER}::test_average_sparse_rounds_the_same_way_on_every_rank",
        ),
        GradedQuestion(
            asks="by how much must the factors' count be smaller than the matrix's, and which side does a tie fall on",
            wrong="compress when the factors' count times the rate is at most the matrix's (<=)",
            caught_by=f"{GRADER}::test_should_compress_is_torchs_rule",
        ),
        GradedQuestion(
            asks="which column keeps its direction under Gram-Schmidt, and so in which order",
            wrong="the columns taken right to left",
            caught_by=f"{GRADER}::test_orthogonalize_is_gram_schmidt_like_torchs",
        ),
        GradedQuestion(
            asks="Where does epsilon enter, so that a zero column stays finite",
            wrong="each column divided by its norm alone, epsilon ignored",
            caught_by=f"{GRADER}::test_orthogonalize_is_gram_schmidt_like_torchs",
        ),
        GradedQuestion(
            asks="which of the two all-reduces needs a division by the world",
            wrong="Q's all-reduce left undivided",
            caught_by=f"{GRADER}::test_powersgd_hook_equals_torchs_step_by_step",
        ),
        GradedQuestion(
            asks="Is P orthogonalized before Q is computed from it, or after",
            wrong="Q computed from the raw all-reduced P, P orthogonalized afterwards",
            caught_by=f"{GRADER}::test_powersgd_hook_equals_torchs_step_by_step",
        ),
    ],
}
