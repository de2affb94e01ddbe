"""Exercise 1.3's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase1/grade_1_3_all_reduce.py"

QUESTIONS = {
    "1.3": [
        GradedQuestion(
            asks="can a rank receive into tensor itself",
            wrong="the root's receives posted into `tensor` itself",
            caught_by=f"{GRADER}::test_every_contribution_is_counted_once",
        ),
        GradedQuestion(
            asks="or two messages into one buffer",
            wrong="one receive buffer shared by every peer's message",
            caught_by=f"{GRADER}::test_every_contribution_is_counted_once",
        ),
        GradedQuestion(
            asks="where does the root's own tensor sit in it when the root is rank 3 of 4",
            wrong="the root starts the fold from its own tensor, then adds the peers",
            caught_by=f"{GRADER}::test_every_rank_holds_the_bits_of_a_rank_order_reduction",
        ),
        GradedQuestion(
            asks="in direct exchange, where does rank 2's own tensor sit",
            wrong="each rank starts the fold from its own tensor, then adds the peers'",
            caught_by=f"{GRADER}::test_every_rank_holds_the_bits_of_a_rank_order_reduction",
        ),
        GradedQuestion(
            asks="in which order does a rank post its messages and wait for them",
            wrong="a blocking send, then a blocking receive, peer after peer",
            caught_by=f"{GRADER}::test_all_reduce_equals_dist_all_reduce",
        ),
        GradedQuestion(
            asks="when may a rank write the result into tensor",
            wrong="the receives waited for, the result written into `tensor`, then the sends "
            "waited for",
            caught_by=f"{GRADER}::test_no_tensor_changes_while_a_send_of_it_is_in_flight",
        ),
    ],
}
