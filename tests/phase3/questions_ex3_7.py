"""Exercise 3.7's guide questions and the test that fails a wrong answer to each.

Each wrong answer was planted in the reference solution (a scratch copy) and the named test
failed with a message about that decision.
"""

from question_grading import GradedQuestion

G = "tests/phase3/grade_3_7_parameter_server.py"
SYNC = f"{G}::test_sync_equals_data_parallel_sgd"
HEADER = f"{G}::test_check_header_refuses_from_the_header"

QUESTIONS = {
    "3.7": [
        GradedQuestion(
            asks="in which order do you place the tensors, and onto which server does each go",
            wrong="the keys placed in key order (or smallest first) onto the least-loaded server",
            caught_by=f"{G}::test_balanced_sharding[2]",
        ),
        GradedQuestion(
            asks="How do you break ties so that the same sizes always give the same assignment",
            wrong="ties between equally loaded servers broken at random",
            caught_by=f"{G}::test_balanced_sharding[2]",
        ),
        GradedQuestion(
            asks="which field must be checked before another may be read",
            wrong="header.dtype read before the dtype code is checked",
            caught_by=HEADER,
        ),
        GradedQuestion(
            asks="How many bytes does a tensor frame's dtype and shape imply",
            wrong="a tensor frame's length only bounded by what its shape implies, not equal to it",
            caught_by=HEADER,
        ),
        GradedQuestion(
            asks="what of a frame that carries no tensor",
            wrong="a control frame's length not checked",
            caught_by=HEADER,
        ),
        GradedQuestion(
            asks="For ssp with staleness s, which clock must be applied before a worker may "
            "compute clock c",
            wrong="clock c - s applied (the gate one clock too strict): the first pull waits "
            "for ever",
            caught_by=SYNC,
        ),
        GradedQuestion(
            asks="For ssp with staleness s, which clock must be applied before a worker may "
            "compute clock c",
            wrong="clock c - s - 2 applied (one clock too loose)",
            caught_by=SYNC,
        ),
        GradedQuestion(
            asks="What does sync do with the staleness it is given",
            wrong="sync honours the staleness setting as ssp does",
            caught_by=SYNC,
        ),
        GradedQuestion(
            asks="in async, by how much must one push's gradient be scaled",
            wrong="the raw gradient applied",
            caught_by=f"{G}::test_async_applies_each_push_at_once_scaled_by_one_over_w[4]",
        ),
        GradedQuestion(
            asks="how do you tell from `self.clock` that a push is for a clock already applied",
            wrong="no push refused: a late push for an applied clock kept in pending",
            caught_by=f"{G}::test_sync_refuses_a_push_for_a_clock_already_applied",
        ),
        GradedQuestion(
            asks="whom does a clock wait for, once a worker has died",
            wrong="every one of the W workers, the dead one included",
            caught_by=f"{G}::test_ssp_goes_on_without_a_killed_worker",
        ),
        GradedQuestion(
            asks="When one clock is applied, may the next be complete already",
            wrong="one clock applied per call (if instead of while)",
            caught_by=f"{G}::test_ssp_applies_every_completed_clock_when_a_member_leaves",
        ),
        GradedQuestion(
            asks="what divides the sum of a clock's gradients",
            wrong="the number of workers W, also in a re-formed clock",
            caught_by=f"{G}::test_sync_reforms_after_a_killed_worker",
        ),
        GradedQuestion(
            asks="which frames go to each server, in what order, stamped with what",
            wrong="the PUSH frames stamped with the previous clock",
            caught_by=SYNC,
        ),
        GradedQuestion(
            asks="which frames go to each server, in what order, stamped with what",
            wrong="the CLOCK frame sent before the PUSH frames",
            caught_by=SYNC,
        ),
    ],
}
