// report.cuh: what a run measured, next to what the book predicts (--report memory,comm).
#pragma once
#include "comm.cuh"
#include "model.cuh"

// Peak and current bytes per memory category, and static bytes per parameter (Playbook §2.4).
void print_memory(const Model& model);
// Per group and collective: calls and bytes each rank sent per step (gathered from every
// rank), next to the ring formulas for the gradient sync of num_params fp32 values
// (Playbook appendix A0). Collective: every rank calls it; rank 0 prints.
void print_comm_report(Comm& comm, int64_t num_params, int64_t steps);
