"""Exercise 2.7's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase2/grade_2_7_context_parallel.py"

QUESTIONS = {
    "2.7": [
        GradedQuestion(
            asks="which two of the 2·cp chunks does rank r hold",
            wrong="two neighbouring chunks, 2r and 2r + 1",
            caught_by=f"{GRADER}::test_zigzag_layout_pairs_an_early_chunk_with_a_late_one",
        ),
        GradedQuestion(
            asks="which single comparison of the query chunk's number with the key chunk's decides",
            wrong="the mirrored rule: key chunks after the query chunk kept whole, those before "
            "it skipped",
            caught_by=f"{GRADER}::test_block_rule_skips_the_future_and_masks_the_diagonal",
        ),
        GradedQuestion(
            asks="what happens without a causal mask",
            wrong="the future blocks skipped and the diagonal masked whether or not the "
            "attention is causal",
            caught_by=f"{GRADER}::test_block_rule_skips_the_future_and_masks_the_diagonal",
        ),
        GradedQuestion(
            asks="what are the union's numerator and denominator",
            wrong="the plain average of the two outs, and the sum of the two lse",
            caught_by=f"{GRADER}::test_merge_of_two_partials_equals_attention_over_both_key_sets",
        ),
        GradedQuestion(
            asks="by which common factor do you multiply both",
            wrong="none: the exponentials of lse_a and lse_b computed as they are",
            caught_by=f"{GRADER}::test_merge_of_two_partials_equals_attention_over_both_key_sets",
        ),
        GradedQuestion(
            asks="on which rank did the K/V block this rank holds start",
            wrong="the rank s places ahead, (rank + s) mod cp, the ring run backwards in the "
            "bookkeeping",
            caught_by=f"{GRADER}::test_ring_attention_output_equals_sdpa_on_the_whole_sequence",
        ),
        GradedQuestion(
            asks="which chunks does that block hold",
            wrong="this rank's own chunk ids, for every visiting block",
            caught_by=f"{GRADER}::test_ring_attention_output_equals_sdpa_on_the_whole_sequence",
        ),
        GradedQuestion(
            asks="when is each pass posted, and when waited for",
            wrong="each pass waited for right after it is posted, before the step's blocks",
            caught_by=f"{GRADER}::test_next_block_is_posted_before_computing_on_the_current_one",
        ),
        GradedQuestion(
            asks="how many passes does a rank post in all",
            wrong="cp: the block passed on at the last step too",
            caught_by=f"{GRADER}::test_each_rank_sends_cp_minus_1_over_cp_of_k_and_v_each_way",
        ),
        GradedQuestion(
            asks="how do they get home",
            wrong="they do not: each rank keeps the dK/dV shares it computed for visiting blocks",
            caught_by=f"{GRADER}::test_ring_attention_gradients_equal_sdpa",
        ),
        GradedQuestion(
            asks="does the home rank's own share have to travel",
            wrong="yes: the travelling sum starts at step 0 with the home rank's share and is "
            "passed at every step, cp passes",
            caught_by=f"{GRADER}::test_each_rank_sends_cp_minus_1_over_cp_of_k_and_v_each_way",
        ),
        GradedQuestion(
            asks="which K/V block is this rank computing with",
            wrong="its own k and v at every step",
            caught_by=f"{GRADER}::test_ring_attention_gradients_equal_sdpa",
        ),
        GradedQuestion(
            asks="what does the home rank do with them",
            wrong="replaces its own share with the sum that came home",
            caught_by=f"{GRADER}::test_ring_attention_gradients_equal_sdpa",
        ),
    ],
}
