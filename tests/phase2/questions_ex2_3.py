"""Exercise 2.3's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase2/grade_2_3_checkpointing.py"

QUESTIONS = {
    "2.3": [
        GradedQuestion(
            asks="which of the tensors the call computes must it not keep",
            wrong="run_function called under torch.enable_grad in forward: the segment's graph, and "
            "every activation inside it, kept for backward",
            caught_by=f"{GRADER}::test_saved_activations_fall_to_order_sqrt_n_and_match_torch_checkpoint",
        ),
        GradedQuestion(
            asks="must it be read before or after run_function runs",
            wrong="the CPU RNG state read after run_function has run (it drew the masks)",
            caught_by=f"{GRADER}::test_checkpointed_gradients_equal_the_plain_model_bitwise_with_dropout",
        ),
        GradedQuestion(
            asks="what must the tensors you recompute from be, so that autograd fills a gradient "
            "for them that you can return",
            wrong="each saved tensor detached, without asking for a gradient again",
            caught_by=f"{GRADER}::test_checkpointed_gradients_equal_the_plain_model_bitwise_with_dropout",
        ),
        GradedQuestion(
            asks="how do you replay the first run's random numbers without moving the caller's "
            "random stream",
            wrong="torch.set_rng_state with the saved state, outside any fork_rng block",
            caught_by=f"{GRADER}::test_checkpointed_gradients_equal_the_plain_model_bitwise_with_dropout",
        ),
        GradedQuestion(
            asks="through which outputs, and starting from which gradients, does the backward "
            "through the recomputed segment go",
            wrong="the recomputed outputs backpropagated with gradients of ones, not the "
            "incoming grad_outputs",
            caught_by=f"{GRADER}::test_checkpointed_gradients_equal_the_plain_model_bitwise_with_dropout",
        ),
        GradedQuestion(
            asks="which segment gains nothing from being checkpointed",
            wrong="every segment, the last one included, goes through checkpoint",
            caught_by=f"{GRADER}::test_each_checkpointed_segment_runs_forward_twice_and_the_last_once",
        ),
    ],
}
