"""Exercise 3.8's guide questions and the test that fails a wrong answer to each.

Each wrong answer was planted in the reference solution (a scratch copy) and the named test
failed with a message about that decision.
"""

from question_grading import GradedQuestion

G = "tests/phase3/grade_3_8_expert_parallel.py"
ROUTE = f"{G}::test_route_keeps_the_k_most_probable_experts_with_weights_summing_to_one"
CAPACITY = f"{G}::test_capacity_keeps_each_experts_first_choices_over_the_whole_group"
OUTPUTS = f"{G}::test_outputs_and_load_balancing_loss_match_one_process[ep2]"
AVERAGED = f"{G}::test_2d_layout_gradients_are_averaged_on_the_right_groups"

QUESTIONS = {
    "3.8": [
        GradedQuestion(
            asks="through which of its outputs must the gradient reach the router",
            wrong="the weights computed from detached probabilities",
            caught_by=ROUTE,
        ),
        GradedQuestion(
            asks="how many choices for expert e stand in its queue before this rank's first "
            "token, and which of your inputs tells this rank so without a message",
            wrong="no choices ahead of this rank (capacity counted per rank, census ignored)",
            caught_by=CAPACITY,
        ),
        GradedQuestion(
            asks="how many choices for expert e stand in its queue before this rank's first token",
            wrong="the census rows up to and including this rank's own",
            caught_by=CAPACITY,
        ),
        GradedQuestion(
            asks="Who knows those numbers, and how do they reach the receiver",
            wrong="no counts exchanged: every rank expects from each peer what it sends that peer",
            caught_by=OUTPUTS,
        ),
        GradedQuestion(
            asks="In what order must the rows bound for one rank leave",
            wrong="the rows sorted by destination rank only, in token order inside each rank",
            caught_by=OUTPUTS,
        ),
        GradedQuestion(
            asks="What travels for a dropped choice",
            wrong="every choice sent, the dropped ones too",
            caught_by=OUTPUTS,
        ),
        GradedQuestion(
            asks="Which of the given functions must move the rows, so that the tokens get their "
            "gradient back",
            wrong="the rows moved with dist.all_to_all_single, detached",
            caught_by=f"{G}::test_gradients_match_one_process[ep2]",
        ),
        GradedQuestion(
            asks="What tells you which (token, choice) each returned row belongs to",
            wrong="the returned rows put in token order as they come (the travelling order)",
            caught_by=OUTPUTS,
        ),
        GradedQuestion(
            asks="What does a token's output weigh each of its returned rows by",
            wrong="the returned rows summed unweighted",
            caught_by=OUTPUTS,
        ),
        GradedQuestion(
            asks="whose losses does the router's gradient already hold on this rank, and which "
            "ranks hold the missing parts",
            wrong="the router's gradient all-reduced on the dp group",
            caught_by=AVERAGED,
        ),
        GradedQuestion(
            asks="The same for an expert's gradient, given what the all-to-all's backward "
            "brought it",
            wrong="the experts' gradients all-reduced on the ep group",
            caught_by=AVERAGED,
        ),
        GradedQuestion(
            asks="How many losses is the mean over, and is that the size of the group an "
            "expert's sum runs over",
            wrong="the experts' gradients divided by the dp group's size",
            caught_by=AVERAGED,
        ),
    ],
}
