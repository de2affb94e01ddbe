"""Exercise 3.1's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase3/grade_3_1_ring.py"
VALUES = f"{GRADER}::test_ring_all_reduce_equals_dist_all_reduce[3]"

QUESTIONS = {
    "3.1": [
        GradedQuestion(
            asks="which chunks are one element longer",
            wrong="the last numel % n chunks take the extra elements",
            caught_by=f"{GRADER}::test_chunk_bounds_are_the_pieces_of_tensor_split",
        ),
        GradedQuestion(
            asks="At step s of the reduce-scatter, which chunk does rank r send and which does "
            "it receive, for any n",
            wrong="rank r sends its own chunk r at step 0 and receives chunk r - 1 - s",
            caught_by=VALUES,
        ),
        GradedQuestion(
            asks="Where does a received segment land before it is reduced",
            wrong="straight into the tensor's own copy of the chunk, overwriting this rank's term",
            caught_by=VALUES,
        ),
        GradedQuestion(
            asks="At step s of the all-gather, which chunk arrives from the left",
            wrong="chunk r - s instead of r - 1 - s",
            caught_by=VALUES,
        ),
        GradedQuestion(
            asks="Which chunk does rank r receive but never send on",
            wrong="every received chunk is sent on, the last step's included",
            caught_by=VALUES,
        ),
        GradedQuestion(
            asks="in what order must the all-gather's receives be posted",
            wrong="the all-gather's receives posted last step first",
            caught_by=VALUES,
        ),
        GradedQuestion(
            asks="who sends the all-gather's first step, this rank's own chunk",
            wrong="nobody: the reduce-scatter run with forward_own=False in ring_all_reduce",
            caught_by=VALUES,
        ),
        GradedQuestion(
            asks="Why can the all-gather's receives not use the reduce-scatter's tag",
            wrong="the all-gather's receives posted under REDUCE_SCATTER_TAG",
            caught_by=VALUES,
        ),
        GradedQuestion(
            asks="When may _finish_all_gather wait for its sends",
            wrong="each all-gather send waited for right after it is posted",
            caught_by=f"{GRADER}::test_every_send_is_waited_for_but_not_before_the_receives",
        ),
        GradedQuestion(
            asks="When may _finish_all_gather wait for its sends",
            wrong="the sends never waited for before returning",
            caught_by=f"{GRADER}::test_every_send_is_waited_for_but_not_before_the_receives",
        ),
        GradedQuestion(
            asks="In a subgroup, which rank number places a rank on the ring",
            wrong="the global rank (dist.get_rank()) as the place on the ring",
            caught_by=f"{GRADER}::test_ring_inside_groups_of_three",
        ),
    ],
}
