"""Exercise 2.5's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

PIPELINE = "tests/phase2/grade_2_5_pipeline.py"
ZERO_BUBBLE = "tests/phase2/grade_2_5_zero_bubble.py"

QUESTIONS = {
    "2.5": [
        # the schedules
        GradedQuestion(
            asks="how many forwards does rank r of p run before its first backward can come "
            "back to it",
            wrong="p - r warm-up forwards, one too many",
            caught_by=f"{PIPELINE}::test_1f1b_warms_up_then_alternates_then_drains",
        ),
        GradedQuestion(
            asks="what caps that count when m is small",
            wrong="nothing: p - 1 - r warm-up forwards even when m is smaller",
            caught_by=f"{PIPELINE}::test_every_microbatch_goes_forward_then_backward_once_per_stage",
        ),
        GradedQuestion(
            asks="after the warm-up, which backward follows each forward",
            wrong="the backward of the micro-batch just forwarded, the warm-up's left for the "
            "drain",
            caught_by=f"{PIPELINE}::test_1f1b_warms_up_then_alternates_then_drains",
        ),
        GradedQuestion(
            asks="how many W's may it still keep waiting without holding more than p micro-batches",
            wrong="none: every W right after its own B",
            caught_by=f"{ZERO_BUBBLE}::test_zb_h1_equals_torchs_zero_bubble_schedule",
        ),
        GradedQuestion(
            asks="how does that count change from rank 0 to rank p - 1",
            wrong="the other way round: rank r keeps p - 1 - r W's waiting",
            caught_by=f"{ZERO_BUBBLE}::test_zb_h1_runs_every_w_after_its_b_and_keeps_1f1b_order_and_memory",
        ),
        GradedQuestion(
            asks="in which order do the W's still waiting at the end run",
            wrong="newest first",
            caught_by=f"{ZERO_BUBBLE}::test_zb_h1_runs_every_w_after_its_b_and_keeps_1f1b_order_and_memory",
        ),
        # the partition
        GradedQuestion(
            asks="the best cut of the first j layers into k stages depends on what",
            wrong="a greedy cut: each stage takes layers until it reaches the total over k",
            caught_by=f"{PIPELINE}::test_balanced_partition_matches_brute_force",
        ),
        GradedQuestion(
            asks="once the best cost is known, how do you get the cut back",
            wrong="walking forward from layer 0, closing a stage whenever the next layer would "
            "push it past the best cost",
            caught_by=f"{PIPELINE}::test_balanced_partition_matches_brute_force",
        ),
        # the messages
        GradedQuestion(
            asks="to which rank does a message for stage s go, in the numbering torch's dst= "
            "and src= use",
            wrong="the rank within the pipeline's group that holds the stage",
            caught_by=f"{PIPELINE}::test_executor_runs_inside_a_subgroup",
        ),
        GradedQuestion(
            asks="which tag do the sender and the receiver use",
            wrong="the receiver tags with the sending stage, the sender with the receiving one",
            caught_by=f"{PIPELINE}::test_executor_matches_the_single_device_model_for_every_schedule",
        ),
        GradedQuestion(
            asks="which of torch's sends keeps send_tensor's promise",
            wrong="dist.send, which waits for the receiver",
            caught_by=f"{PIPELINE}::test_executor_matches_the_single_device_model_for_every_schedule",
        ),
        GradedQuestion(
            asks="who waits for it",
            wrong="send_tensor itself, right after posting the isend",
            caught_by=f"{PIPELINE}::test_executor_matches_the_single_device_model_for_every_schedule",
        ),
        GradedQuestion(
            asks="how large is the receive buffer, and where do its shape and dtype come from",
            wrong="the header's shape in the default dtype (float32) instead of the header's dtype",
            caught_by=f"{PIPELINE}::test_executor_matches_the_single_device_model_for_every_schedule",
        ),
        # the executor
        GradedQuestion(
            asks="what must be true of a received activation so that a gradient for it exists "
            "after the backward",
            wrong="nothing: the received tensor used as it arrived, without requires_grad_",
            caught_by=f"{PIPELINE}::test_executor_matches_the_single_device_model_for_every_schedule",
        ),
        GradedQuestion(
            asks="what does the last stage do with its output, and scaled by what",
            wrong="the micro-batch's mean loss, not scaled by 1/m",
            caught_by=f"{PIPELINE}::test_executor_matches_the_single_device_model_for_every_schedule",
        ),
        GradedQuestion(
            asks="from what does the last stage's backward start, and from what every other "
            "stage's",
            wrong="every stage but the last from its output with a gradient of ones",
            caught_by=f"{PIPELINE}::test_executor_matches_the_single_device_model_for_every_schedule",
        ),
        GradedQuestion(
            asks="what does a stage with no parameters, whose input needs no gradient, have to do",
            wrong="backpropagate anyway from its output, which has no graph",
            caught_by=f"{PIPELINE}::test_pipeline_training_follows_the_single_device_model",
        ),
        GradedQuestion(
            asks="with respect to which tensors does B differentiate",
            wrong="the full backward in B, the weights' gradients included",
            caught_by=f"{ZERO_BUBBLE}::test_zero_bubble_executor_matches_the_single_device_model",
        ),
        GradedQuestion(
            asks="what must it leave of the graph for W",
            wrong="nothing: B's autograd.grad without retain_graph frees it",
            caught_by=f"{ZERO_BUBBLE}::test_zero_bubble_executor_matches_the_single_device_model",
        ),
        GradedQuestion(
            asks="what must its B still do so that its W can run",
            wrong="nothing: stage 0's B returns before filling the weight stash",
            caught_by=f"{ZERO_BUBBLE}::test_zero_bubble_executor_matches_the_single_device_model",
        ),
        GradedQuestion(
            asks="with respect to which tensors does W differentiate, and from which gradient",
            wrong="the parameters, from a gradient of ones instead of the stashed one",
            caught_by=f"{ZERO_BUBBLE}::test_zero_bubble_executor_matches_the_single_device_model",
        ),
        GradedQuestion(
            asks="how does its result reach .grad so that the m micro-batches add up",
            wrong="assigned to .grad (torch.autograd.grad's result), replacing what was there",
            caught_by=f"{ZERO_BUBBLE}::test_zero_bubble_executor_matches_the_single_device_model",
        ),
    ],
}
