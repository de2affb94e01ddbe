"""Exercise 3.3's guide questions and the test that fails a wrong answer to each."""

from question_grading import GradedQuestion

SIMULATED = "tests/phase3/grade_3_3_hierarchical.py::test_hierarchical_on_simulated_nodes[2x2]"

QUESTIONS = {
    "3.3": [
        GradedQuestion(
            asks="what must its node have reduced before anything crosses, and which part of "
            "that does the rank hold then",
            wrong="the whole tensor all-reduced across nodes, then within the node",
            caught_by=SIMULATED,
        ),
        GradedQuestion(
            asks="Which ranks on the other nodes hold the same part of their own node's sum, "
            "and which of the topology's groups joins them",
            wrong="the chunk's all-reduce run on intra_node_group instead of inter_node_group",
            caught_by=SIMULATED,
        ),
        GradedQuestion(
            asks="Once that part is reduced over the whole world, how do the other ranks of "
            "the node get it",
            wrong="no all-gather inside the node after the all-reduce across nodes",
            caught_by=SIMULATED,
        ),
    ],
}
