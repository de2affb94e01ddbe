"""Exercise 1.2's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

GRADER = "tests/phase1/grade_1_2_averaging.py"

QUESTIONS = {
    "1.2": [
        GradedQuestion(
            asks="which tensors does a model's state_dict() hold besides its parameters",
            wrong="the parameters alone broadcast, the buffers left as each rank had them",
            caught_by=f"{GRADER}::test_broadcast_parameters_copies_parameters_and_buffers_from_src",
        ),
        GradedQuestion(
            asks="what must it be handed so that the model keeps its own tensor objects",
            wrong="a copy of each parameter broadcast, then set on the model as a new Parameter",
            caught_by=f"{GRADER}::test_broadcast_parameters_copies_parameters_and_buffers_from_src",
        ),
        GradedQuestion(
            asks="which argument of torch's call takes a rank of the group",
            wrong="the group rank passed as src= (a global rank) to dist.broadcast",
            caught_by=f"{GRADER}::test_broadcast_averaging_and_step_inside_subgroups",
        ),
        GradedQuestion(
            asks="what turns the sum into the mean, and which count divides it inside the group",
            wrong="no division: the all-reduced sum left in .grad",
            caught_by=f"{GRADER}::test_average_gradients_is_the_mean_over_ranks",
        ),
        GradedQuestion(
            asks="what turns the sum into the mean, and which count divides it inside the group",
            wrong="the sum divided by the world's size (dist.get_world_size() without the group)",
            caught_by=f"{GRADER}::test_broadcast_averaging_and_step_inside_subgroups",
        ),
        GradedQuestion(
            asks="how many calls of all_reduce_fn does a model with six gradient tensors of one "
            "dtype need",
            wrong="one all_reduce_fn call per gradient tensor",
            caught_by=f"{GRADER}::test_average_gradients_hands_over_one_buffer_per_dtype",
        ),
        GradedQuestion(
            asks="and one whose gradients come in float32 and float64",
            wrong="one buffer for every gradient, the float32 ones widened to float64 by torch.cat",
            caught_by=f"{GRADER}::test_average_gradients_hands_over_one_buffer_per_dtype",
        ),
        GradedQuestion(
            asks="where does the averaging go among clearing the gradients, forward, backward and "
            "the optimizer's step",
            wrong="the averaging after the optimizer's step",
            caught_by=f"{GRADER}::test_dp_step_equals_one_process_on_the_whole_batch",
        ),
        GradedQuestion(
            asks="what would the previous step's gradients do to this step if nothing cleared them",
            wrong="the gradients never cleared (no zero_grad)",
            caught_by=f"{GRADER}::test_dp_step_equals_one_process_on_the_whole_batch",
        ),
        GradedQuestion(
            asks="how many readings of the clock does the split into two parts take",
            wrong="three readings: the optimizer's step left out of both parts",
            caught_by=f"{GRADER}::test_dp_step_times_compute_and_communication_apart",
        ),
        GradedQuestion(
            asks="what must happen before each reading so that the split holds on a GPU too",
            wrong="the clock read without synchronize after the work before it",
            caught_by=f"{GRADER}::test_dp_step_waits_for_the_device_before_each_reading",
        ),
    ],
}
