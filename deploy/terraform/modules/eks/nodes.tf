resource "aws_iam_role" "node" {
  name = "${var.name}-node"
  assume_role_policy = jsonencode({
    Version   = "2012-10-17"
    Statement = [{ Effect = "Allow", Action = "sts:AssumeRole", Principal = { Service = "ec2.amazonaws.com" } }]
  })
  tags = var.tags
}

resource "aws_iam_role_policy_attachment" "node" {
  for_each = toset([
    "arn:aws:iam::aws:policy/AmazonEKSWorkerNodePolicy",
    "arn:aws:iam::aws:policy/AmazonEKS_CNI_Policy",
    "arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryReadOnly",
  ])
  role       = aws_iam_role.node.name
  policy_arn = each.value
}

# The CPU pool: the chart's CPU pods and the cluster's system pods.
resource "aws_eks_node_group" "cpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "cpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  ami_type        = "AL2023_x86_64_STANDARD"
  instance_types  = var.cpu_instance_types
  disk_size       = var.node_disk_gb

  scaling_config {
    desired_size = var.cpu_node_count.desired
    min_size     = var.cpu_node_count.min
    max_size     = var.cpu_node_count.max
  }
  update_config {
    max_unavailable = 1
  }
  labels = { "servelm.io/pool" = "cpu" }
  tags   = var.tags

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size] # the autoscaler owns it after creation
  }
  depends_on = [aws_iam_role_policy_attachment.node]
}

# The GPU pool: NVIDIA AMI (driver and container toolkit installed), tainted so only pods that tolerate
# nvidia.com/gpu (the chart with gpu.count > 0) land there; the label matches the chart's gpu.nodeSelector.
resource "aws_eks_node_group" "gpu" {
  cluster_name    = aws_eks_cluster.this.name
  node_group_name = "gpu"
  node_role_arn   = aws_iam_role.node.arn
  subnet_ids      = aws_subnet.private[*].id
  ami_type        = "AL2023_x86_64_NVIDIA"
  instance_types  = var.gpu_instance_types
  disk_size       = var.node_disk_gb

  scaling_config {
    desired_size = var.gpu_node_count.desired
    min_size     = var.gpu_node_count.min
    max_size     = var.gpu_node_count.max
  }
  update_config {
    max_unavailable = 1
  }
  labels = { "servelm.io/pool" = "gpu", "nvidia.com/gpu.present" = "true" }
  taint {
    key    = "nvidia.com/gpu"
    value  = "true"
    effect = "NO_SCHEDULE"
  }
  tags = var.tags

  lifecycle {
    ignore_changes = [scaling_config[0].desired_size]
  }
  depends_on = [aws_iam_role_policy_attachment.node]
}
