"""Exercise 2.2's guide questions and the test that fails a wrong answer to each.

Each wrong answer was planted in the reference solution (a scratch copy) and the named test
failed with a message about that decision."""

from question_grading import GradedQuestion

GRADER = "tests/phase2/grade_2_2_mixed_precision.py"

QUESTIONS = {
    "2.2": [
        GradedQuestion(
            asks="which number, computed in which dtype, and rounded to float32 when",
            wrong="every gradient divided in place by the float32 scale",
            caught_by=f"{GRADER}::test_unscaled_gradients_equal_grad_scalers_bitwise",
        ),
        GradedQuestion(
            asks="which collective makes every rank of the group hold the same flag",
            wrong="no collective: each rank decides from its own gradients",
            caught_by=f"{GRADER}::test_an_overflow_on_one_rank_skips_the_step_on_every_rank",
        ),
        GradedQuestion(
            asks="on which group does it run",
            wrong="the flag all-reduced on the whole world instead of self.group",
            caught_by=f"{GRADER}::test_the_overflow_flag_stays_inside_the_scalers_group",
        ),
        GradedQuestion(
            asks="what must unscale_ leave behind so that step(), called after it in the same "
            "iteration, does not divide the gradients a second time",
            wrong="unscale_ does not set self._unscaled",
            caught_by=f"{GRADER}::test_unscaled_gradients_equal_grad_scalers_bitwise",
        ),
        GradedQuestion(
            asks="in which dtype does GradScaler multiply the float32 scale by a factor, and when "
            "is the product rounded to float32",
            wrong="the float32 scale tensor multiplied in place by the factor (float32 arithmetic)",
            caught_by=f"{GRADER}::test_loss_scaler_equals_grad_scaler_for_any_factor",
        ),
        GradedQuestion(
            asks="which of the forward, the loss and the backward must run under autocast",
            wrong="only the forward under autocast, the loss computed after it (also planted: "
            "no autocast at all)",
            caught_by=f"{GRADER}::test_mixed_precision_step_runs_the_forward_and_the_loss_under_autocast",
        ),
        GradedQuestion(
            asks="in which order do the backward of the scaled loss, the unscaling, the clipping, "
            "the scaler's step and the update run",
            wrong="the clipping before unscale_, on the scaled gradients",
            caught_by=f"{GRADER}::test_clipping_sees_unscaled_gradients_like_the_grad_scaler_recipe",
        ),
        GradedQuestion(
            asks="when a step overflows, who decides that the optimizer does not step, and is the "
            "scale updated on that step too",
            wrong="optimizer.step() called directly after unscale_ (also planted: update only "
            "when the step ran)",
            caught_by=f"{GRADER}::test_an_overflowing_step_changes_nothing_and_backs_off_once",
        ),
        GradedQuestion(
            asks="where do the masters' gradients come from",
            wrong="the masters' gradients never set from the model's",
            caught_by=f"{GRADER}::test_master_weights_keep_updates_too_small_for_bf16",
        ),
        GradedQuestion(
            asks="what does a parameter that got no gradient give its master",
            wrong="a zero gradient for the master of a parameter without one",
            caught_by=f"{GRADER}::test_master_weights_skip_overflows_and_leave_unused_parameters_alone",
        ),
        GradedQuestion(
            asks="who decides whether the masters' optimizer steps",
            wrong="the masters' optimizer stepped directly, the scaler ignored",
            caught_by=f"{GRADER}::test_master_weights_skip_overflows_and_leave_unused_parameters_alone",
        ),
        GradedQuestion(
            asks="when are the model's weights refreshed from the masters",
            wrong="the model's parameters never copied back from the masters",
            caught_by=f"{GRADER}::test_master_weights_keep_updates_too_small_for_bf16",
        ),
    ],
}
