"""Exercise 2.4's guide questions and the test that fails a wrong answer to each.

Each wrong answer was planted in the reference solution (a scratch copy) and the named test
failed with a message about that decision (a hang is reported with the ranks stuck, their lines
and the messages never matched)."""

from question_grading import GradedQuestion

GRADER = "tests/phase2/grade_2_4_model_parallel.py"

QUESTIONS = {
    "2.4": [
        GradedQuestion(
            asks="what does it receive first, and how does it learn the data's dtype and shape",
            wrong="the data buffer allocated with torch.empty of the announced shape (float32)",
            caught_by=f"{GRADER}::test_the_receiver_allocates_the_dtype_the_header_announces",
        ),
        GradedQuestion(
            asks="which of them is a rank within group, and which a global rank",
            wrong="dist.send with dst= the group's rank (taken as a global rank)",
            caught_by=f"{GRADER}::test_model_parallel_runs_inside_a_subgroup",
        ),
        GradedQuestion(
            asks="what must a tensor's memory layout be for torch to send it",
            wrong="the data sent detached but not made contiguous",
            caught_by=f"{GRADER}::test_activations_arrive_with_their_shape_and_dtype",
        ),
        GradedQuestion(
            asks="where does this rank's input come from, the batch or a message from which rank, "
            "and where does its output go",
            wrong="every rank but the first receives its input from rank 0 (also planted: every "
            "rank returns its output, not only the last)",
            caught_by=f"{GRADER}::test_loss_and_gradients_equal_the_single_device_model",
        ),
        GradedQuestion(
            asks="what must it be made into so that, after backward, its gradient exists to be "
            "sent back",
            wrong="the received activation used as it arrives, without requires_grad_()",
            caught_by=f"{GRADER}::test_loss_and_gradients_equal_the_single_device_model",
        ),
        GradedQuestion(
            asks="what starts this rank's backward, the loss or a message from which rank, and "
            "into what buffer does that message arrive",
            wrong="the output's gradient received with recv_activation (a header first) while "
            "the sender sends the gradient alone",
            caught_by=f"{GRADER}::test_loss_and_gradients_equal_the_single_device_model",
        ),
        GradedQuestion(
            asks="what does it send back, to whom",
            wrong="the input's gradient never sent back",
            caught_by=f"{GRADER}::test_loss_and_gradients_equal_the_single_device_model",
        ),
        GradedQuestion(
            asks="which rank sends nothing back, and what must a first stage without parameters "
            "still receive",
            wrong="a stage whose output needs no gradient (a lone Flatten) skips receiving it",
            caught_by=f"{GRADER}::test_loss_and_gradients_equal_the_single_device_model",
        ),
        GradedQuestion(
            asks="what must stage_input and stage_output hold between forward and backward, and "
            "after backward",
            wrong="stage_input and stage_output kept after backward",
            caught_by=f"{GRADER}::test_loss_and_gradients_equal_the_single_device_model",
        ),
    ],
}
